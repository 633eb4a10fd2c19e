"""How a strategy's saved per-parameter state maps to one canonical form and back.

The canonical form of a range of a parameter is three float64 1-D tensors: ``weight`` (the
best value the state holds: fp32 master, theta + dtheta, weight + compensation or
remainder, scaled data x scale), ``exp_avg`` and ``exp_avg_sq`` (Adam's own moments;
Collage-plus: v + dv), all exact in float64. A strategy's ``state_form`` turns
``FullState.read``'s components into it (``to_canonical``) and back (``from_canonical``:
what its own checkpoint would hold), element by element but for what ``tensor_scales``
takes from the whole tensor first (Scalify's scales); ``AdamStep`` undoes a stored bias
correction (bf16_kahan). ``holds`` names each value's format (``FORMATS``); a conversion
is exact when the target's formats contain the source's (``contains``), else it rounds
within ``BOUNDS`` (8-bit: ``BLOCK_BOUND`` of the block's absmax; scaled fp16 below its
normal range: ``SCALED_BOUND`` of the tensor's RMS). Formats, bounds and the table of
exact pairs: docs/runs.md, "Switching strategy on resume".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collage_train.scalify.scale import ExactFp16Scales

CANONICAL = ("weight", "exp_avg", "exp_avg_sq")
FORMATS = ("fp32", "bf16", "bf16+bf16", "bf16/debiased", "8bit", "fp16/scaled")
# The largest relative error, per element, of rounding a value into each format (normal
# numbers; the unit roundoff 2^-p of p significant bits): bf16 8 bits, fp32 24, bf16+bf16
# the value's bf16 rounding and that of the rest (2^-8 of 2^-8 of it); fp16/scaled 11 bits
# where the data is an fp16 normal number.
BOUNDS = {"bf16": 2.0**-8, "fp32": 2.0**-24, "bf16+bf16": 2.0**-16, "bf16/debiased": 2.0**-8,
          "fp16/scaled": 2.0**-11}  # fmt: skip
# 8-bit blockwise codes (``8bit``) are bounded against their block's absmax, not per element
# (an element far below it rounds to 0 or to the map's smallest value):
BLOCK_BOUND = 2.0**-6  # half the map's widest gap, 0.0070 below -0.99297 (docs/strategies.md)
# Scaled fp16 (``fp16/scaled``: fp16 data x a power-of-two scale per tensor, at most twice its
# RMS) below 2^-14 of the scale is subnormal data, 2^-24 apart: an element moves by at most
# half that, 2^-25 of the scale, so 2^-24 of the tensor's RMS (one under 2^-25 of it: to 0).
SCALED_BOUND = 2.0**-24
Components = dict[str, torch.Tensor]
CanonicalOf = Callable[[int, int], Components]  # [lo, hi) of a parameter -> its canonical form


def contains(outer: str, inner: str) -> bool:
    """Whether every value of format ``inner`` is a value of format ``outer``."""
    if inner == "8bit":  # code x scale: one fp32 product; a requantised block moves
        return outer == "fp32"
    if inner == "fp16/scaled":  # 11 bits within fp32's range; a bf16 and the 3-bit rest
        return outer in ("fp16/scaled", "fp32", "bf16+bf16")
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
        """This strategy's components (FullState's names and dtypes) of ``canonical``; a
        range of a parameter with its whole tensor's ``tensor_scales`` beside it."""
        raise NotImplementedError

    def tensor_scales(self, canonical_of: CanonicalOf, numel: int) -> Components:
        """What ``from_canonical`` of a range needs of its whole tensor of ``numel``
        elements (``canonical_of(lo, hi)``), as 0-d tensors; {}: nothing (element-wise)."""
        return {}

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


# Elements of a parameter ``ScaledForm.tensor_scales`` reads at a time.
SCALE_WINDOW = 2**22


@dataclass(frozen=True)
class ScaledForm(StateForm):
    """Scalify's state (``scalify.adamw.ScaledAdamW``) in the whole-tensor form: fp16 data
    and, per element, its tensor's power-of-two scale. ``params="fp16"`` (scalify): the
    weight is scaled fp16 (``weight_scale``), an fp32 ``master`` beside it with
    ``master="fp32"``; ``"fp32"`` (scalify_fp32_params): the fp32 weight, which holds the
    scaled-fp16 master exactly (``master_scale``) with ``master="fp16"``. ``state``: the
    moments' format (fp32 ones under scales of 1). Read as it finds the components (any
    options); written as ``params``, ``master`` and ``state`` say, each scaled value under
    its whole tensor's RMS scale (``tensor_scales``)."""

    params: str = "fp16"
    master: str = "fp16"
    state: str = "fp16"

    @property
    def holds(self) -> dict[str, str]:  # type: ignore[override]
        moment = "fp16/scaled" if self.state == "fp16" else "fp32"
        return {"weight": "fp16/scaled" if self.master == "fp16" else "fp32",
                "exp_avg": moment, "exp_avg_sq": moment}  # fmt: skip

    def to_canonical(self, components: Components, at: AdamStep) -> Components:
        if "master" in components:  # a copy beside the weight (an fp16 one: scaled)
            out = {"weight": _descaled(components, "master", "master_scale")}
        else:  # scaled fp16, or an fp32 weight (holding the scaled-fp16 master exactly)
            out = {"weight": _descaled(components, "weight", "weight_scale")}
        for name in ("exp_avg", "exp_avg_sq"):
            out[name] = _descaled(components, name, f"{name}_scale")
        return out

    def _scaled(self) -> dict[str, str]:
        """canonical value -> the component naming its scale, for each value stored scaled
        (a scalify weight beside an fp32 master too: the weight is its scaled rounding)."""
        scaled = {}
        if self.params == "fp16":
            scaled["weight"] = "weight_scale"
        elif self.master == "fp16":
            scaled["weight"] = "master_scale"
        if self.state == "fp16":
            scaled.update(exp_avg="exp_avg_scale", exp_avg_sq="exp_avg_sq_scale")
        return scaled

    def tensor_scales(self, canonical_of: CanonicalOf, numel: int) -> Components:
        """Each scaled value's scale (``_scaled``'s names, 0-d fp32): the power-of-two RMS
        scale ScaledAdamW gives it, or a neighbour (x2, /2) where only that one holds every
        element in fp16 exactly (the RMS of stored data can round across a power of two
        from that of the value its scale was taken from): scaled fp16 stays bit for bit."""
        scaled = self._scaled()
        if not scaled:
            return {}
        rms, exact = _one_pass(canonical_of, list(scaled), numel)
        options = torch.stack([rms, rms * 2, rms / 2], dim=1)  # per value: first choice first
        choice = [next((c for c, scale in enumerate(row) if held.holds(scale)), 0)
                  for row, held in zip(options, exact, strict=True)]  # fmt: skip
        return {name: options[row, choice[row]] for row, name in enumerate(scaled.values())}

    def from_canonical(self, canonical: Components, at: AdamStep) -> Components:
        scaled = self._scaled()
        scales = {name: canonical[name] for name in scaled.values() if name in canonical}
        numel = canonical["weight"].numel()
        if len(scales) < len(scaled):  # a whole tensor, alone
            scales = self.tensor_scales(lambda lo, hi: _range(canonical, lo, hi), numel)
        out: Components = {}
        for key in CANONICAL:
            value, name = canonical[key], scaled.get(key)
            if name is None:  # fp32: the value itself (moments under scales of 1)
                out[key] = value.to(torch.float32)
                if key != "weight":
                    out[f"{key}_scale"] = torch.ones(numel)
                continue
            data = _fp16_nearest(value / scales[name].double())
            out[name] = scales[name].to(torch.float32).expand(numel).clone()
            if key == "weight" and self.params == "fp32":  # the fp32 weight holds the master
                out[key] = (data.double() * scales[name].double()).to(torch.float32)
            else:
                out[key] = data
        if self.params == "fp16" and self.master == "fp32":
            out["master"] = canonical["weight"].to(torch.float32)
        return out


def _one_pass(
    canonical_of: CanonicalOf, keys: list[str], numel: int
) -> tuple[torch.Tensor, list[ExactFp16Scales]]:
    """Reading the whole tensor once, SCALE_WINDOW elements at a time: the power-of-two
    RMS scale of each canonical value ``keys`` (``scalify.scale.rms_scales_from_sums``:
    float64 sums of squares, 1 for zeros) and the scales under which fp16 holds it."""
    from collage_train.scalify.scale import ExactFp16Scales, rms_scales_from_sums

    sums = torch.zeros(len(keys), dtype=torch.float64)
    exact = [ExactFp16Scales() for _ in keys]
    for lo in range(0, numel, SCALE_WINDOW):
        values = canonical_of(lo, min(lo + SCALE_WINDOW, numel))
        sums += torch.stack([values[key].square().sum() for key in keys])
        for key, held in zip(keys, exact, strict=True):
            held.add(values[key])
    return rms_scales_from_sums(sums, torch.tensor(float(numel), dtype=torch.float64)), exact


def _descaled(components: Components, key: str, scale_key: str) -> torch.Tensor:
    """``components[key]`` in float64, times ``components[scale_key]`` where there is one."""
    value = _f64(components[key])
    return value * _f64(components[scale_key]) if scale_key in components else value


def _range(canonical: Components, lo: int, hi: int) -> Components:
    return {key: canonical[key][lo:hi] for key in CANONICAL}


def _fp16_nearest(value: torch.Tensor) -> torch.Tensor:
    """float64 ``value`` rounded once to fp16, to nearest (torch rounds through fp32: a value
    just past a midpoint of fp16 can land on its other side), clamped to fp16's range as
    ``scalify.scale.store_scaled`` clamps."""
    limit = float(torch.finfo(torch.float16).max)
    value = value.clamp(-limit, limit)
    first = value.to(torch.float16)
    toward = torch.where(value > first.double(), torch.inf, -torch.inf).to(torch.float16)
    other = torch.nextafter(first, toward)
    nearer = (value - other.double()).abs() < (value - first.double()).abs()  # a tie: first
    return torch.where(nearer, other, first)
