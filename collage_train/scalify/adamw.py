"""AdamW whose moments (and optionally master weights) are stored as scaled fp16.

Each state tensor is fp16 data plus a power-of-two fp32 scale: the value is
``data * scale``. A step loads each tensor into fp32, does the AdamW math there, and
stores it back under a fresh scale, ``rms_scale`` of the new value, so the data sits near
unit RMS and neither overflows nor underflows fp16. ``master="fp32"`` or ``"fp16"``
chooses the master's format (a parameter held as scaled fp16 is itself the fp16
master); ``scaled=False`` pins every scale at 1, ``state="fp32"`` keeps plain fp32
moments. A flat ZeRO partition listed in ``flat_pieces`` keeps one scale per piece, the
whole model tensor's, so it stores what an unsharded run does. ``rescale_count`` and
``scale_metrics()`` report the rescales and the share of stored data outside
``[1/16, 16]`` RMS. Step counts, bias corrections and weight decay as in
``collage_train.optim.adamw.AdamW``.

Details: docs/strategies.md, "ScaledAdamW: moments and masters as scaled fp16".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from collage_train.optim.base import (
    TrackingOptimizer,
    bias_corrections,
    commit_,
    flat_view,
    write_back,
)
from collage_train.scalify.params import (
    holds_exactly,
    is_scaled,
    store_value,
    value_of,
)
from collage_train.scalify.pieces import PieceChunks
from collage_train.scalify.scale import (
    FP16_MAX,
    SCALE_ATTR,
    STORAGE_DTYPE,
    load_scaled,
    per_element,
    store_scaled,
)

__all__ = ["ScaledAdamW", "load_scaled", "store_scaled"]

STATE_DTYPE = STORAGE_DTYPE
MASTERS = ("fp32", "fp16")
STATES = ("fp32", "fp16")
RMS_RANGE = (1.0 / 16.0, 16.0)


class ScaledAdamW(TrackingOptimizer):
    """AdamW with scaled-fp16 ``exp_avg`` / ``exp_avg_sq`` (and master if ``master="fp16"``)."""

    unshaped_state = ("step", "exp_avg_scale", "exp_avg_sq_scale", "master_scale", "piece_lengths")
    masks_on_device = True  # ``step_mask``: the old scales kept and no data written if False

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
        ones = torch.ones(len(pieces.lengths), device=value.device)
        if dtype == torch.float32:
            return value.clone(), ones
        flat = value.reshape(-1)
        layout = PieceChunks(flat.numel(), pieces, flat.device)
        sums = layout.zero_sums()
        layout.add_squares(sums, flat, 0, flat.numel())
        scale = layout.scales(sums, self.scaled)
        data, _ = _scaled_chunk(flat, layout.scale_of(scale, 0, flat.numel()))
        return data.view_as(value), scale

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
        master when it is scaled fp16, a scaled parameter's own data included), piece by
        piece in a flat ZeRO partition (each piece has its own scale), whose RMS is not
        zero (all-zero data, e.g. the moments of a parameter that never got a gradient,
        holds nothing to place). Read a chunk at a time, as the step is.
        """
        low, high = RMS_RANGE
        outside = total = 0
        for param, state in self.state.items():
            if "exp_avg" not in state:
                continue
            layout = PieceChunks(param.numel(), self.flat_pieces.get(param), param.device)
            for flat, scale in self._stored_data(state, param):
                sums = layout.zero_sums()
                for lo, hi in self._chunks(param.numel()):
                    data = (
                        flat[lo:hi]
                        if scale is None
                        else flat[lo:hi] / layout.scale_of(scale, lo, hi)
                    )
                    layout.add_squares(sums, data, lo, hi)
                rms = (sums / layout.lengths.to(sums).clamp(min=1)).sqrt()
                total += int((rms > 0).sum())
                outside += int(((rms > 0) & ((rms < low) | (rms > high))).sum())
        return {
            "scalify_rescales": float(self.rescale_count),
            "scalify_rms_outside_frac": outside / total if total else 0.0,
        }

    def _stored_data(
        self, state: dict[str, Any], param: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each scaled entry of ``param``'s state as ``(flat tensor, scale)``: its stored
        data is the tensor (scale None), or the tensor over the scale (the fp16 master
        that an fp32 parameter holds as its value)."""
        stored: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for name in ("exp_avg", "exp_avg_sq", "master"):
            if f"{name}_scale" not in state:
                continue
            if name == "master" and self._master_in_param(state):
                stored.append((param.detach().reshape(-1), state["master_scale"]))
            else:
                stored.append((state[name].reshape(-1), None))
        if is_scaled(param) and "master" not in state:  # the parameter is the fp16 master
            stored.append((param.detach().reshape(-1), None))
        return stored

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
            pieces = self.flat_pieces.get(param)
            for name in ("exp_avg", "exp_avg_sq"):  # zero: data 0, scale 1 (as store_scaled)
                state[name] = torch.zeros_like(param, dtype=self.state_dtype)
                state[f"{name}_scale"] = torch.ones(
                    () if pieces is None else len(pieces.lengths), device=param.device
                )
            if self._keeps_master(param) and self.master == "fp16" and param.dtype == torch.float32:
                self._round_into_param(state, param)
            elif self._keeps_master(param):
                self._set_master(state, param, value_of(param))
        return state

    def _round_into_param(self, state: dict[str, Any], param: torch.Tensor) -> None:
        """An fp32 parameter takes its scaled-fp16 rounding as the master it holds (fresh
        scale per piece), a chunk at a time (``_set_master`` without a whole fp32 copy)."""
        layout = PieceChunks(param.numel(), self.flat_pieces.get(param), param.device)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        flat_param, chunks = flat_view(param.detach(), pending), self._chunks(param.numel())
        sums = layout.zero_sums()
        for lo, hi in chunks:
            layout.add_squares(sums, flat_param[lo:hi], lo, hi)
        scale = layout.scales(sums, self.scaled)
        for lo, hi in chunks:
            _, rounded = _scaled_chunk(flat_param[lo:hi], layout.scale_of(scale, lo, hi))
            flat_param[lo:hi].copy_(rounded)
        write_back(pending)
        state["master_scale"] = scale

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

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for param in params:
            self._step_param(group, param)

    def _weight_kind(self, state: dict[str, Any], param: torch.Tensor) -> str:
        """Where the weight the update applies to lives, and how it is written back:
        ``scaled`` (the scaled fp16 parameter is the master), ``scaled_copy`` (an fp32
        master beside a scaled parameter), ``in_param`` (an fp32 parameter holding the
        scaled-fp16 master exactly), ``param`` (an fp32 parameter is the master),
        ``fp16_copy`` / ``fp32_copy`` (a master copy beside a parameter of another dtype)."""
        if is_scaled(param):
            return "scaled_copy" if "master" in state else "scaled"
        if "master" not in state:
            return "in_param" if "master_scale" in state else "param"
        return "fp16_copy" if "master_scale" in state else "fp32_copy"

    @torch.no_grad()
    def _step_param(self, group: dict[str, Any], param: torch.Tensor) -> None:
        """One AdamW update of ``param``, ``step_chunk_numel`` elements at a time.

        Every scaled entry written gets a fresh power-of-two RMS scale (per piece of a
        flat partition), which needs the whole new value's RMS before any of it is
        stored: the fp32 math is done once to sum the squares of the new moments, once
        for the new weight's (where it is stored under a fresh scale), and a last time
        to store them chunk by chunk, each pass reading only the old state. The
        temporaries are a few fp32 copies of one chunk, never of the whole tensor (a
        whole ZeRO partition); the numbers are the same whatever the chunk size, up to
        the order of the float64 sums that choose a power of two. EDQ partials are
        recorded as the chunks are written.
        """
        state = self._state_for(param)
        state["step"] += 1
        step, (beta1, beta2) = state["step"], group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        bias1, bias2_sqrt = bias_corrections(beta1, beta2, step)
        kind = self._weight_kind(state, param)
        layout = PieceChunks(param.numel(), self.flat_pieces.get(param), param.device)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # written back at the end
        flat_param = flat_view(param.detach(), pending)
        grad, grad_scale = param.grad.reshape(-1), getattr(param.grad, SCALE_ATTR, None)
        moments = {name: flat_view(state[name], pending) for name in ("exp_avg", "exp_avg_sq")}
        old_scales = {name: state[f"{name}_scale"] for name in ("exp_avg", "exp_avg_sq")}
        master = flat_view(state["master"], pending) if "master" in state else None
        if kind == "scaled":
            old_scales["weight"] = getattr(param, SCALE_ATTR)
        elif kind == "scaled_copy":
            old_scales["param"] = getattr(param, SCALE_ATTR)
        elif kind in ("in_param", "fp16_copy"):
            old_scales["weight"] = state["master_scale"]
        chunks = self._chunks(param.numel())

        def new_moments(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = grad[lo:hi].to(torch.float32)
            if grad_scale is not None:
                g = g * grad_scale
            m, v = (
                moments[name][lo:hi].to(torch.float32) * layout.scale_of(old_scales[name], lo, hi)
                for name in ("exp_avg", "exp_avg_sq")
            )
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            return m, v

        def weight_of(lo: int, hi: int) -> torch.Tensor:
            """The fp32 master the update applies to (a copy for stored data)."""
            if kind in ("param", "in_param"):
                return flat_param[lo:hi]
            if kind == "fp32_copy" or kind == "scaled_copy":
                return master[lo:hi]
            data = flat_param if kind == "scaled" else master
            return data[lo:hi].to(torch.float32) * layout.scale_of(old_scales["weight"], lo, hi)

        def new_weight(
            lo: int, hi: int, m: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """The new fp32 master of ``[lo, hi)`` and the update, from the new moments
            ``m`` and ``v`` (unrounded; consumed)."""
            update = m.div_(v.sqrt_().div_(bias2_sqrt).add_(eps)).mul_(-lr / bias1)
            weight = weight_of(lo, hi)
            if weight_decay != 0.0:
                update.add_(weight, alpha=-lr * weight_decay)
            return weight + update, update

        fresh_moments = self.state_dtype != torch.float32 and self.scaled
        new_scales = {name: torch.ones_like(old_scales[name]) for name in moments}
        if fresh_moments:
            sums = {name: layout.zero_sums() for name in moments}
            for lo, hi in chunks:
                for name, value in zip(moments, new_moments(lo, hi), strict=True):
                    layout.add_squares(sums[name], value, lo, hi)
            new_scales = {name: layout.scales(sums[name]) for name in moments}
        # the weight's (or the scaled parameter beside an fp32 master's) fresh scale
        fresh_weight = next((key for key in ("weight", "param") if key in old_scales), None)
        if fresh_weight is not None:
            sums = layout.zero_sums()
            for lo, hi in chunks:
                layout.add_squares(sums, new_weight(lo, hi, *new_moments(lo, hi))[0], lo, hi)
            new_scales[fresh_weight] = layout.scales(sums, self.scaled)

        mask = self.step_mask  # a False one: the old scales kept, nothing written
        if mask is not None:
            new_scales = {k: torch.where(mask, s, old_scales[k]) for k, s in new_scales.items()}
        edq = self._edq_sums(param)
        for lo, hi in chunks:
            m, v = new_moments(lo, hi)
            for name, value in (("exp_avg", m), ("exp_avg_sq", v)):
                _store_chunk(moments[name], lo, hi, value, layout, new_scales[name], mask)
            weight, update = new_weight(lo, hi, m, v)
            del m, v
            if mask is not None:
                update = torch.where(mask, update, 0.0)
            before = self._model_chunk(kind, flat_param, old_scales, layout, lo, hi, copy=True)
            if kind == "param":
                commit_(flat_param[lo:hi], weight, mask)
            elif kind == "fp32_copy":
                commit_(master[lo:hi], weight, mask)
                commit_(flat_param[lo:hi], weight, mask)
            elif kind == "scaled_copy":
                commit_(master[lo:hi], weight, mask)
                _store_chunk(flat_param, lo, hi, weight, layout, new_scales["param"], mask)
            elif kind == "in_param":  # the fp32 parameter holds the fp16 master's value
                scale = layout.scale_of(new_scales["weight"], lo, hi)
                commit_(flat_param[lo:hi], _scaled_chunk(weight, scale)[1], mask)
            else:  # fp16 data under the new scale: the parameter itself, or a copy beside it
                data = flat_param if kind == "scaled" else master
                stored = _store_chunk(data, lo, hi, weight, layout, new_scales["weight"], mask)
                if kind == "fp16_copy":
                    commit_(flat_param[lo:hi], stored, mask)
            if edq is not None:
                after_scales = {**old_scales, **new_scales}
                after = self._model_chunk(kind, flat_param, after_scales, layout, lo, hi)
                edq.add(lo, before, after, update)
        write_back(pending)
        for name in moments:
            self._note_rescale(old_scales[name], new_scales[name])
            state[f"{name}_scale"] = new_scales[name]
        if kind in ("in_param", "fp16_copy"):
            self._note_rescale(old_scales["weight"], new_scales["weight"])
            state["master_scale"] = new_scales["weight"]
        elif kind in ("scaled", "scaled_copy"):
            key = "weight" if kind == "scaled" else "param"
            self._note_rescale(old_scales[key], new_scales[key])
            getattr(param, SCALE_ATTR).copy_(new_scales[key])  # every holder sees it
        self._keep_edq(param, edq)

    def _note_rescale(self, old: torch.Tensor, new: torch.Tensor) -> None:
        if not torch.equal(old, new):
            self.rescale_count += 1

    @staticmethod
    def _model_chunk(
        kind: str,
        flat_param: torch.Tensor,
        scales: dict[str, torch.Tensor],
        layout: PieceChunks,
        lo: int,
        hi: int,
        copy: bool = False,
    ) -> torch.Tensor:
        """The elements ``[lo, hi)`` of the weight the model computes with (a scaled
        parameter's values) under ``scales``; ``copy``: never a view of the parameter."""
        if kind in ("scaled", "scaled_copy"):
            key = "weight" if kind == "scaled" else "param"
            return flat_param[lo:hi].to(torch.float32) * layout.scale_of(scales[key], lo, hi)
        chunk = flat_param[lo:hi]
        return chunk.to(torch.float32, copy=True) if copy else chunk


def _store_chunk(
    data: torch.Tensor,
    lo: int,
    hi: int,
    value: torch.Tensor,
    layout: PieceChunks,
    scale: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``value`` (fp32, the elements ``[lo, hi)``) into ``data`` under ``scale``:
    fp16 data clamped to the fp16 range, or the value itself for fp32 data, where ``mask``
    (``TrackingOptimizer.step_mask``) holds. Returns the value stored (``data * scale``)."""
    if data.dtype == torch.float32:
        commit_(data[lo:hi], value, mask)
        return value
    stored, value_stored = _scaled_chunk(value, layout.scale_of(scale, lo, hi))
    commit_(data[lo:hi], stored, mask)
    return value_stored


def _scaled_chunk(value: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 data of ``value`` under ``scale`` (per element or 0-d), clamped to the fp16
    range as ``store_scaled`` does, and the value it stands for."""
    data = (value / scale).clamp_(-FP16_MAX, FP16_MAX).to(STATE_DTYPE)
    return data, data.to(torch.float32) * scale
