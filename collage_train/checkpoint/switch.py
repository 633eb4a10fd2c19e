"""Switching precision strategy on resume: a checkpoint's state read as another strategy's.

``switched(state, source, target)`` is the ``FullState`` that strategy ``target`` would
have saved: each range read from ``state`` goes through the canonical form
(``precision.state_form``: ``target.from_canonical(source.to_canonical(...))``, with the
whole tensor's ``tensor_scales`` taken once per parameter), so every engine's elastic
resume and every layout writer takes it as it takes any checkpoint. The step counts, the
trainer's client state (step, data position, lr-schedule position, RNG) pass through
unchanged; ``betas`` (the source run's, this run's) turn moments stored bias-corrected
into Adam's own and back; ``options`` (the runs' ``precision`` configs) are Scalify's.
``measure`` reports what the switch cost, measured: each parameter converted, read back to
canonical and compared with the source's canonical values (the largest relative error of
an element, per canonical value).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from collage_train.checkpoint.param_state import FullState
from collage_train.errors import ConfigError
from collage_train.precision import get_strategy
from collage_train.precision.state_form import CANONICAL, AdamStep, StateForm, contains

# meta.json's record of a switch made offline (``convert --precision``).
SWITCHED = "switched"


Options = Mapping[str, Any] | None  # a run's ``precision`` config; None: the defaults
NO_OPTIONS: tuple[Options, Options] = (None, None)


def form_of(name: str, options: Options = None) -> StateForm:
    """Strategy ``name``'s state form with ``options`` (Scalify's: its master and moment
    formats); a one-line ConfigError where it has none."""
    strategy = get_strategy(name)
    if options is not None:
        strategy = strategy.configured(SimpleNamespace(**options))
    form = strategy.state_form
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


def exact(source: str, target: str, options: tuple[Options, Options] = NO_OPTIONS) -> bool:
    """Whether ``target`` holds every canonical value of ``source`` exactly."""
    if source == target:
        return True
    held, holding = form_of(source, options[0]).holds, form_of(target, options[1]).holds
    return all(contains(holding[key], held[key]) for key in CANONICAL)


Betas = tuple[tuple[float, float], tuple[float, float]]  # the source run's, the target's


def betas_of(config: dict[str, Any]) -> tuple[float, float]:
    """AdamW's betas in a run's resolved ``config`` (meta.json's)."""
    first, second = config["optim"]["betas"]
    return float(first), float(second)


def switched(
    state: FullState,
    source: str,
    target: str,
    betas: Betas,
    options: tuple[Options, Options] = NO_OPTIONS,
) -> FullState:
    """``state`` (written by ``source``) as strategy ``target`` holds it."""
    if source == target:
        return state
    read_from, write_to = form_of(source, options[0]), form_of(target, options[1])
    scales: dict[str, dict[str, torch.Tensor]] = {}  # per parameter, its whole tensor's

    def canonical(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        at = AdamStep(state.steps[name], betas[0])
        return read_from.to_canonical(state.read(name, start, stop), at)

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        if name not in scales:
            whole = functools.partial(canonical, name)
            scales[name] = write_to.tensor_scales(whole, state.numel(name))
        at = AdamStep(state.steps[name], betas[1])
        return write_to.from_canonical({**canonical(name, start, stop), **scales[name]}, at)

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
    largest relative error per canonical value, measured; ``forms``: what each side holds,
    ``StateForm.describe``, the strategies' defaults where not given)."""

    source: str
    target: str
    step: int
    errors: dict[str, float]
    forms: tuple[str, str] | None = field(default=None, compare=False)

    @property
    def exact(self) -> bool:
        return all(error == 0 for error in self.errors.values())

    def line(self) -> str:
        """The one line a resume and ``convert --precision`` print."""
        cost = ", ".join(f"{key} {self.errors[key]:.2g}" for key in CANONICAL)
        kind = "exact" if self.exact else "rounded"
        held, holding = self.forms or (form_of(self.source).describe(),
                                       form_of(self.target).describe())  # fmt: skip
        return (
            f"switched precision {self.source} -> {self.target} at step {self.step}: converted "
            f"{held} -> {holding}; step, "
            f"data and lr-schedule position kept; {kind}, largest relative error against "
            f"the source: {cost}"
        )

    def record(self) -> dict[str, Any]:
        """The switch as JSON (summary.json, W&B's config, meta.json of a conversion)."""
        forms = {"forms": list(self.forms)} if self.forms else {}
        return {"from": self.source, "to": self.target, "step": self.step,
                "exact": self.exact, "max_rel_error": dict(self.errors), **forms}  # fmt: skip

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Switch:
        """The switch ``record`` describes (one written before ``forms`` were recorded:
        named with the strategies' default options)."""
        forms = tuple(record["forms"]) if "forms" in record else None
        return cls(record["from"], record["to"], int(record["step"]),
                   dict(record["max_rel_error"]), forms)  # fmt: skip


def measure(
    state: FullState,
    source: str,
    target: str,
    betas: Betas,
    options: tuple[Options, Options] = NO_OPTIONS,
) -> Switch:
    """Convert every parameter of ``state`` from ``source`` to ``target``, read it back to
    canonical and compare with the source's canonical values (one parameter at a time)."""
    read_from, write_to = form_of(source, options[0]), form_of(target, options[1])
    errors = dict.fromkeys(CANONICAL, 0.0)
    for name in state.shapes:
        there, here = AdamStep(state.steps[name], betas[0]), AdamStep(state.steps[name], betas[1])
        before = read_from.to_canonical(state.read(name), there)
        after = write_to.to_canonical(write_to.from_canonical(before, here), here)
        for key in CANONICAL:
            errors[key] = max(errors[key], relative_error(after[key], before[key]))
    forms = (read_from.describe(), write_to.describe())
    return Switch(source, target, int(state.trainer["step"]), errors, forms)
