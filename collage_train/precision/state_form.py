"""How a strategy's saved per-parameter state maps to one canonical form and back.

The canonical form of a range of a parameter is three float64 1-D tensors: ``weight`` (the
best value the state holds: fp32 master, theta + dtheta, weight + compensation or
remainder), ``exp_avg`` and ``exp_avg_sq`` (Adam's own moments; Collage-plus: v + dv), all
exact in float64. A strategy's ``state_form`` turns ``FullState.read``'s components into it
(``to_canonical``) and back (``from_canonical``: what its own checkpoint would hold),
element by element; ``AdamStep`` (step, betas) undoes a stored bias correction
(bf16_kahan). ``holds`` names each value's format: ``fp32``, ``bf16``, ``bf16+bf16``,
``bf16/debiased`` or ``8bit``; a conversion is exact when the target's formats contain the
source's (``contains``), else it rounds within ``BOUNDS`` (8-bit: ``BLOCK_BOUND`` of the
block's absmax). Formats, bounds and the table of exact pairs: docs/runs.md, "Switching
strategy on resume".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

CANONICAL = ("weight", "exp_avg", "exp_avg_sq")
FORMATS = ("fp32", "bf16", "bf16+bf16", "bf16/debiased", "8bit")
# The largest relative error, per element, of rounding a value into each format (normal
# numbers; the unit roundoff 2^-p of p significant bits): bf16 8 bits, fp32 24, bf16+bf16
# the value's bf16 rounding and that of the rest (2^-8 of 2^-8 of it).
BOUNDS = {"bf16": 2.0**-8, "fp32": 2.0**-24, "bf16+bf16": 2.0**-16, "bf16/debiased": 2.0**-8}
# 8-bit blockwise codes (``8bit``) are bounded against their block's absmax, not per element
# (an element far below it rounds to 0 or to the map's smallest value):
BLOCK_BOUND = 2.0**-6  # half the map's widest gap, 0.0070 below -0.99297 (docs/strategies.md)
Components = dict[str, torch.Tensor]


def contains(outer: str, inner: str) -> bool:
    """Whether every value of format ``inner`` is a value of format ``outer``."""
    if inner == "8bit":  # code x scale: one fp32 product; a requantised block moves
        return outer == "fp32"
    return outer == inner or (inner == "bf16" and outer in ("fp32", "bf16+bf16"))


@dataclass(frozen=True)
class AdamStep:
    """A parameter's optimizer step count and betas: what turns a bias-corrected moment
    into Adam's own (``m * (1 - b1^t)``, ``v * (1 - b2^t)``) and back."""

    step: int
    betas: tuple[float, float]

    def corrections(self) -> tuple[float, float]:
        """``(1 - b1^t, 1 - b2^t)``; 1 before the first step (the moments are 0)."""
        if self.step <= 0:
            return 1.0, 1.0
        return tuple(1.0 - beta**self.step for beta in self.betas)  # type: ignore[return-value]


def _f64(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.float64)


def _split(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``value`` -> (its bf16 rounding, the bf16 rounding of the rest)."""
    high = value.to(torch.bfloat16)
    return high, (value - _f64(high)).to(torch.bfloat16)


class StateForm:
    """A strategy's per-parameter state <-> the canonical form (module docstring)."""

    holds: Mapping[str, str]

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        """The canonical float64 ``weight``, ``exp_avg``, ``exp_avg_sq`` of ``components``."""
        raise NotImplementedError

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        """This strategy's components (FullState's names and dtypes) of ``canonical``."""
        raise NotImplementedError

    def describe(self) -> str:
        """What the weight and moments are held as, for the switch's line."""
        return ", ".join(f"{key} {self.holds[key]}" for key in CANONICAL)


def _moments_in(components: Components) -> Components:
    return {key: _f64(components[key]) for key in ("exp_avg", "exp_avg_sq")}


def _moments_out(canonical: Components, dtype: torch.dtype) -> Components:
    return {key: canonical[key].to(dtype) for key in ("exp_avg", "exp_avg_sq")}


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


@dataclass(frozen=True)
class PlainForm(StateForm):
    """The weight itself and two moments (fp32: all fp32; bf16, bf16_sr: all bf16)."""

    weight: torch.dtype
    moments: torch.dtype

    @property
    def holds(self) -> dict[str, str]:  # type: ignore[override]
        return {"weight": _name(self.weight), "exp_avg": _name(self.moments),
                "exp_avg_sq": _name(self.moments)}  # fmt: skip

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        return {"weight": _f64(components["weight"]), **_moments_in(components)}

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        return {"weight": canonical["weight"].to(self.weight),
                **_moments_out(canonical, self.moments)}  # fmt: skip


@dataclass(frozen=True)
class MasterForm(StateForm):
    """A bf16 weight, the fp32 ``master`` it rounds, and moments (mixed_fp32: fp32;
    bf16_moments: bf16). A state saved before the first step has no master yet: the
    weight is it."""

    moments: torch.dtype

    @property
    def holds(self) -> dict[str, str]:  # type: ignore[override]
        return {"weight": "fp32", "exp_avg": _name(self.moments),
                "exp_avg_sq": _name(self.moments)}  # fmt: skip

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        master = components.get("master", components["weight"])
        return {"weight": _f64(master), **_moments_in(components)}

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        master = canonical["weight"].to(torch.float32)
        return {"weight": master.to(torch.bfloat16), "master": master,
                **_moments_out(canonical, self.moments)}  # fmt: skip


@dataclass(frozen=True)
class CompensatedForm(StateForm):
    """A bf16 weight and its bf16 low part ``low`` (Collage's ``dtheta``, the Kahan
    compensation ``kahan_comp``): the value is their sum. bf16 moments; with ``dv``
    (Collage-plus) the second moment is ``exp_avg_sq + dv``; ``debiased`` (bf16_kahan):
    stored bias-corrected."""

    low: str
    dv: bool = False
    debiased: bool = False

    @property
    def holds(self) -> dict[str, str]:  # type: ignore[override]
        moment = "bf16/debiased" if self.debiased else "bf16"
        return {"weight": "bf16+bf16", "exp_avg": moment,
                "exp_avg_sq": "bf16+bf16" if self.dv else moment}  # fmt: skip

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        moments = _moments_in(components)
        if self.dv:
            moments["exp_avg_sq"] = moments["exp_avg_sq"] + _f64(components["dv"])
        if self.debiased:
            for key, correction in zip(("exp_avg", "exp_avg_sq"), at.corrections(), strict=True):
                moments[key] = moments[key] * correction
        weight = _f64(components["weight"]) + _f64(components[self.low])
        return {"weight": weight, **moments}

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        m, v = canonical["exp_avg"], canonical["exp_avg_sq"]
        if self.debiased:
            m1, m2 = at.corrections()
            m, v = m / m1, v / m2
        weight, low = _split(canonical["weight"])
        out = {"weight": weight, self.low: low, "exp_avg": m.to(torch.bfloat16)}
        if self.dv:
            out["exp_avg_sq"], out["dv"] = _split(v)
        else:
            out["exp_avg_sq"] = v.to(torch.bfloat16)
        return out


@dataclass(frozen=True)
class SplitForm(StateForm):
    """split_fp32: the fp32 master as the bf16 weight + an int16 ``remainder`` (and the
    positions of its ties, ``optim.remainder``); fp32 moments."""

    holds = {"weight": "fp32", "exp_avg": "fp32", "exp_avg_sq": "fp32"}  # noqa: RUF012

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        from collage_train.optim import remainder  # the optimizers load only when used

        ties = components.get("remainder_ties", torch.zeros(0, dtype=torch.int64))
        master = remainder.join(components["weight"], components["remainder"], ties)
        return {"weight": _f64(master), **_moments_in(components)}

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        from collage_train.optim import remainder

        weight, low, ties = remainder.split(canonical["weight"].to(torch.float32))
        return {"weight": weight, "remainder": low, "remainder_ties": ties,
                **_moments_out(canonical, torch.float32)}  # fmt: skip


@dataclass(frozen=True)
class BlockwiseForm(StateForm):
    """8-bit blockwise moments (``optim.blockwise8``) in the whole-tensor form of a
    checkpoint's state (``checkpoint.whole_tensor``): uint8 codes and, per element, the
    fp32 absmax of its block (``exp_avg`` signed, ``exp_avg_sq`` unsigned), beside the
    weight of ``weights`` (adamw_8bit: ``MasterForm``; collage_8bit:
    ``CompensatedForm("dtheta")``). Quantised anew in blocks of 256 from the range's first
    element (a whole parameter: the blocks on the whole tensor); a positive v is never
    stored as 0 (``keep_nonzero``): beside an m that is not, the step would divide by eps
    alone."""

    weights: StateForm

    @property
    def holds(self) -> dict[str, str]:  # type: ignore[override]
        return {"weight": self.weights.holds["weight"], "exp_avg": "8bit", "exp_avg_sq": "8bit"}

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        from collage_train.optim import blockwise8  # the optimizers load only when used

        plain = dict(components)
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            code = blockwise8.dynamic_map(signed, components[key].device)
            plain[key] = code[components[key].long()] * plain.pop(f"{key}_absmax")
        return self.weights.to_canonical(plain, at)

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        from collage_train.optim import blockwise8

        out = self.weights.from_canonical(canonical, at)
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            value = canonical[key].to(torch.float32)
            codes, absmax = blockwise8.quantize(value, signed, keep_nonzero=not signed)
            blocks = torch.arange(codes.numel(), device=codes.device) // blockwise8.BLOCK_SIZE
            out[key], out[f"{key}_absmax"] = codes, absmax[blocks]
        return out
