"""AdamW whose moments (and optionally master weights) are stored as scaled fp16.

Each state tensor is fp16 data plus a power-of-two fp32 scale: the value is
``data * scale``. A step loads each tensor into fp32, does the AdamW math there,
and stores it back under a fresh scale, ``rms_scale`` of the new value, so the data
sits near unit RMS and neither overflows nor underflows fp16 whatever the size of
the gradients. ``rescale_count`` counts the times a stored scale changed.

``master="fp32"`` updates fp32 parameters in place (or an fp32 master copy of
lower-precision parameters); ``master="fp16"`` keeps the master as scaled fp16 too
and writes its value into the parameters. An fp32 parameter then holds the master's
value exactly, so only its scale is stored (``master_scale``); a lower-precision
parameter gets its own fp16 ``master`` data. A parameter held as scaled fp16
(``collage_train.scalify.params``: fp16 data with its scale beside, the 8-byte layout)
is itself the fp16 master: the step reads its value and gradient through their scales
and stores the new value back into its data and scale, keeping no copy; with
``master="fp32"`` it gets an fp32 master copy instead. ``scaled=False`` pins every scale at 1:
plain fp16 state, the baseline that under- and overflows. ``state="fp32"`` keeps the
moments as plain fp32 (scale pinned at 1), the paper's fp32-optimizer-state setting.

A flat tensor listed in ``flat_pieces`` (the pieces of model tensors it holds: a ZeRO
partition, ``ZeroEngine.prepare``) keeps one scale per piece for each scaled entry
instead of one for the whole flat tensor: the scale of the model tensor the piece
belongs to, summed over every rank's pieces of it (``FlatPieces.whole``), so that each
tensor is stored under the scale an unsharded run gives it. The piece lengths are kept
in the state (``piece_lengths``) beside the scales they go with.

``scale_metrics()`` reports the rescales so far and the share of state tensors whose
stored data has an RMS outside ``[1/16, 16]`` (the range Scalify keeps data in).

Step counts are integers, bias corrections host float64, weight decay decoupled,
as in ``collage_train.optim.AdamW``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from collage_train.optim.base import TrackingOptimizer
from collage_train.scalify.params import (
    grad_value,
    holds_exactly,
    is_scaled,
    store_value,
    value_of,
)
from collage_train.scalify.scale import (
    STORAGE_DTYPE,
    load_scaled,
    per_element,
    store_scaled,
    store_scaled_segments,
)

__all__ = ["ScaledAdamW", "load_scaled", "store_scaled"]

STATE_DTYPE = STORAGE_DTYPE
MASTERS = ("fp32", "fp16")
STATES = ("fp32", "fp16")
RMS_RANGE = (1.0 / 16.0, 16.0)


class ScaledAdamW(TrackingOptimizer):
    """AdamW with scaled-fp16 ``exp_avg`` / ``exp_avg_sq`` (and master if ``master="fp16"``)."""

    unshaped_state = ("step", "exp_avg_scale", "exp_avg_sq_scale", "master_scale", "piece_lengths")

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master: str = "fp32",
        scaled: bool = True,
        state: str = "fp16",
    ) -> None:
        if master not in MASTERS:
            raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        super().__init__(params, lr, betas, eps, weight_decay)
        self.master = master
        self.scaled = scaled
        self.state_dtype = torch.float16 if state == "fp16" else torch.float32
        self.rescale_count = 0

    def _store_scaled(
        self, param: torch.Tensor, value: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` of ``value`` for a state entry of ``param``: one scale, or one
        per piece where ``flat_pieces`` lists the parameter (every rank calls this for
        its partition of the same group together: the scales may need a collective)."""
        pieces = self.flat_pieces.get(param)
        if pieces is None:
            return store_scaled(value, self.scaled, dtype)
        return store_scaled_segments(value, pieces.lengths, self.scaled, dtype, pieces.whole)

    def _per_element(self, param: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The scale of a state entry of ``param`` to multiply its data by."""
        pieces = self.flat_pieces.get(param)
        return per_element(scale, pieces.lengths if pieces is not None else None)

    def _load(self, param: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return load_scaled(data, self._per_element(param, scale))

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus the rescale count, so a resumed run keeps counting."""
        return {**super().state_dict(), "rescale_count": self.rescale_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.rescale_count = int(state_dict.pop("rescale_count", 0))
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def scale_metrics(self) -> dict[str, float]:
        """``scalify_rescales`` (scale changes so far) and ``scalify_rms_outside_frac``.

        The fraction is over the stored data of every state tensor (moments, and the
        master when it is scaled fp16, a scaled parameter's own data included) whose RMS
        is not zero (all-zero tensors, e.g. the moments of a parameter that never got a
        gradient, hold no data to place).
        """
        low, high = RMS_RANGE
        outside = total = 0
        for param, state in self.state.items():
            stored = [
                self._scaled_data(state, name, param)
                for name in ("exp_avg", "exp_avg_sq", "master")
                if f"{name}_scale" in state
            ]
            if is_scaled(param) and "master" not in state:
                stored.append(param.detach())  # the parameter is the fp16 master
            for data in stored:
                rms = data.to(torch.float64).square().mean().sqrt().item() if data.numel() else 0
                if rms == 0:
                    continue
                total += 1
                outside += not low <= rms <= high
        return {
            "scalify_rescales": float(self.rescale_count),
            "scalify_rms_outside_frac": outside / total if total else 0.0,
        }

    def _keeps_master(self, param: torch.Tensor) -> bool:
        """Whether the master has state of its own (a scale, or data) beside the parameter."""
        if is_scaled(param):  # the scaled-fp16 parameter is the fp16 master itself
            return self.master == "fp32"
        return self.master == "fp16" or param.dtype != torch.float32

    @staticmethod
    def _master_in_param(state: dict[str, Any]) -> bool:
        """A scaled-fp16 master of an fp32 parameter is held by the parameter itself.

        The parameter always equals ``data * scale`` exactly (fp16 data times a power
        of two is an fp32 value), so only the scale is stored: 2 bytes per parameter
        less than a separate fp16 copy, and the same numbers.
        """
        return "master_scale" in state and "master" not in state

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            if param in self.flat_pieces:  # on record beside the scales, one per piece
                state["piece_lengths"] = self.flat_pieces[param].lengths.clone()
            for name in ("exp_avg", "exp_avg_sq"):
                zeros = torch.zeros_like(param, dtype=torch.float32)
                state[name], state[f"{name}_scale"] = self._store_scaled(
                    param, zeros, self.state_dtype
                )
            if self._keeps_master(param):
                self._set_master(state, param, value_of(param))
        return state

    def _set_master(self, state: dict[str, Any], param: torch.Tensor, value: torch.Tensor) -> None:
        """The master becomes ``value`` (rounded to scaled fp16 for ``master="fp16"``).

        A value that the current scale already represents exactly keeps that scale (a
        round trip through ``load_full_precision_weights`` changes nothing); any other
        gets a fresh one.
        """
        if self.master != "fp16":
            state["master"] = value.clone()
            return
        scale = state.get("master_scale")
        if scale is not None and holds_exactly(value, self._per_element(param, scale)):
            data = (value / self._per_element(param, scale)).to(STATE_DTYPE)
        else:
            data, scale = self._store_scaled(param, value, STATE_DTYPE)
        state["master_scale"] = scale
        if param.dtype == torch.float32:
            param.detach().copy_(self._load(param, data, scale))
        else:
            state["master"] = data

    def _scaled_data(self, state: dict[str, Any], name: str, param: torch.Tensor) -> torch.Tensor:
        """The stored data of the scaled entry ``name`` (the parameter's, for its master)."""
        if name == "master" and self._master_in_param(state):
            return (param.detach() / self._per_element(param, state["master_scale"])).to(
                STATE_DTYPE
            )
        return state[name]

    def _master_value(self, state: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
        """The fp32 weight the update applies to: a master copy, the scaled parameter's
        value, or the fp32 parameter itself."""
        if "master" in state:
            if "master_scale" in state:
                return self._load(param, state["master"], state["master_scale"])
            return state["master"]
        if is_scaled(param):
            return value_of(param)
        return param.detach()

    def _model_view(self, param: torch.Tensor) -> torch.Tensor:
        """The weight the model computes with: a scaled parameter's value (for EDQ)."""
        return value_of(param) if is_scaled(param) else param.detach()

    def _snapshot(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Copies of the weights the model computes with, only when descent is tracked."""
        return [value_of(p) for p in params] if self.track_edq else None

    def _store(
        self, state: dict[str, Any], param: torch.Tensor, name: str, value: torch.Tensor
    ) -> torch.Tensor:
        """Store ``value`` into the scaled entry ``name``, counting a change of scale.

        Returns the value stored (``data * scale``). The master of an fp32 parameter is
        stored by the caller writing that value into the parameter.
        """
        dtype = STATE_DTYPE if name == "master" else self.state_dtype
        data, scale = self._store_scaled(param, value, dtype)
        if not torch.equal(scale, state[f"{name}_scale"]):
            self.rescale_count += 1
        state[f"{name}_scale"] = scale
        if not (name == "master" and "master" not in state):
            state[name] = data
        return self._load(param, data, scale)

    def _full_precision(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state.get(param, {})
        if "master" in state:
            return self._master_value(state, param).to(torch.float32, copy=True)
        return value_of(param)  # a new fp32 tensor: the scaled or fp32 parameter's value

    def _load_full_precision(self, param: torch.Tensor, value: torch.Tensor) -> None:
        if is_scaled(param):
            if self.master == "fp32":  # the copy, and its scaled-fp16 rounding as the weight
                self._state_for(param)["master"] = value.clone()
            store_value(param, value, self.scaled, keep_exact=True)
            return
        if self._keeps_master(param):
            state = self._state_for(param)
            self._set_master(state, param, value)
            value = self._master_value(state, param)
        param.detach().copy_(value)

    def _step_one(self, group: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
        """One AdamW update of ``param`` in fp32; returns the update applied."""
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        state = self._state_for(param)
        state["step"] += 1
        step = state["step"]
        grad = grad_value(param)  # through the gradient's scale where it carries one
        exp_avg = self._load(param, state["exp_avg"], state["exp_avg_scale"])
        exp_avg_sq = self._load(param, state["exp_avg_sq"], state["exp_avg_sq_scale"])
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        del grad  # fp32 temporaries are freed as soon as they are used (the step's peak)

        denom = exp_avg_sq.sqrt().div_(math.sqrt(1.0 - beta2**step)).add_(group["eps"])
        update = exp_avg.div(denom).mul_(-lr / (1.0 - beta1**step))
        del denom
        self._store(state, param, "exp_avg", exp_avg)
        self._store(state, param, "exp_avg_sq", exp_avg_sq)
        del exp_avg, exp_avg_sq
        weight = self._master_value(state, param)
        if weight_decay != 0.0:
            update.add_(weight, alpha=-lr * weight_decay)

        if is_scaled(param):  # the parameter holds (or rounds) the master as scaled fp16
            # value_of made ``weight`` a copy: update it in place (an fp32 master: a new one)
            new_weight = weight + update if "master" in state else weight.add_(update)
            if "master" in state:
                state["master"] = new_weight
            if store_value(param, new_weight, self.scaled):
                self.rescale_count += 1
            return update
        if "master" not in state and "master_scale" not in state:
            param.detach().add_(update)
            return update
        new_weight = weight + update
        if "master_scale" in state:
            new_weight = self._store(state, param, "master", new_weight)
        else:
            state["master"] = new_weight
        param.detach().copy_(new_weight)
        return update

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        before = self._snapshot(params)
        updates = [self._step_one(group, param) for param in params]
        self._record_edq(params, before, updates)
