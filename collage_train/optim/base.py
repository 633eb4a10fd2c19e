"""What the project's optimizers share: exact state restore, descent tracking, and the
full-precision value of every weight (read and written by the replica engines)."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from collage_train.metrics.edq import FIELDS, edq_metrics, edq_partials

# What one element of a chunk may cost during a step: Collage's eager step's fp32
# temporaries (memory_plan.STEP_TRANSIENT: up to 39 bytes in mode plus) and, with EDQ
# tracked, the copy of the weight and the intended update (2 + 2).
STEP_BYTES_PER_ELEMENT = 43
MIN_CHUNK_NUMEL, MAX_CHUNK_NUMEL = 1 << 14, 1 << 22


# Sums and element counts per piece -> the same for the whole tensor each piece belongs to.
PieceTotals = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FlatPieces:
    """The pieces of model tensors that one flat tensor holds, in order (a ZeRO partition).

    ``lengths``: elements of each consecutive piece, covering the flat tensor (padding is a
    piece of its own). ``whole``: given a float64 sum and an element count per piece,
    returns the sum and count of the whole tensor each piece belongs to, over every rank
    (ZeRO: one all-reduce), so that a statistic per tensor is the one an unsharded run
    computes; None: each piece stands alone.
    """

    lengths: torch.Tensor
    whole: PieceTotals | None = None


class EdqSums:
    """EDQ partial sums of one tensor stepped a chunk at a time: one row per
    ``edq_segments`` range (a flat ZeRO partition) or one for the whole tensor."""

    def __init__(
        self,
        segments: list[tuple[str, int, int]] | None,
        numel: int,
        view: torch.dtype | None,
        device: torch.device,
    ) -> None:
        self.segmented = segments is not None
        self.ranges = segments if segments is not None else [("", 0, numel)]
        self.view = view
        self.sums = torch.zeros(len(self.ranges), len(FIELDS), device=device)

    def add(
        self,
        start: int,
        before: torch.Tensor,
        after: torch.Tensor,
        update: torch.Tensor,
        dtheta: torch.Tensor | None = None,
    ) -> None:
        """Partials of the chunk of flattened elements starting at ``start``."""
        if self.view is not None and after.dtype != self.view:
            before, after = before.to(self.view), after.to(self.view)
        stop = start + after.numel()
        for row, (_, first, last) in enumerate(self.ranges):
            low, high = max(first, start) - start, min(last, stop) - start
            if low < high:
                low_part = dtheta[low:high] if dtheta is not None else None
                self.sums[row] += edq_partials(
                    before[low:high], after[low:high], update[low:high], low_part
                )

    def add_partials(self, partials: torch.Tensor) -> None:
        """Partials a step summed itself over a chunk of a tensor with no segments."""
        self.sums[0] += partials

    def rows(self) -> torch.Tensor:
        return self.sums if self.segmented else self.sums[0]


def flat_view(tensor: torch.Tensor, pending: list[tuple[torch.Tensor, torch.Tensor]]):
    """``tensor`` as 1-D, in the order of its elements: a view when it is contiguous; else a
    contiguous copy, listed in ``pending`` to be written back (``write_back``) after the
    step (a transposed weight or gradient: the copy is the size of that tensor only)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    flat = tensor.contiguous().view(-1)
    pending.append((tensor, flat))
    return flat


def commit_(target: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> None:
    """``target.copy_(value)`` where ``mask`` (a 0-d bool tensor, or None: always) holds;
    ``target`` keeps its bits where it does not, whatever ``value`` holds (NaN included)."""
    if mask is None:
        target.copy_(value)
    elif target.is_contiguous():  # in place: one pass, no temporary
        torch.where(mask, value.to(target.dtype), target, out=target)
    else:
        target.copy_(torch.where(mask, value.to(target.dtype), target))


def write_back(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``flat_view`` copy back into the tensor it was taken from."""
    for tensor, flat in pending:
        tensor.copy_(flat.view(tensor.shape))


def chunk_ranges(numel: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``chunk`` elements (one at least) covering ``numel``."""
    chunk = max(1, chunk)
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """Adam's ``1 - beta1^t`` and ``sqrt(1 - beta2^t)`` for integer step ``t``, in float64."""
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def chunk_numel_for(state_bytes: float) -> int:
    """Elements stepped (or tracked) at a time so that a step's transients stay within
    2% of ``state_bytes`` (the model state this rank holds), kept within [2^14, 2^22]."""
    budget = int(0.02 * state_bytes / STEP_BYTES_PER_ELEMENT)
    return min(MAX_CHUNK_NUMEL, max(MIN_CHUNK_NUMEL, budget))


class TrackingOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base of the AdamW family.

    Setting ``track_edq = True`` clears ``last_edq`` and makes the following
    ``step`` calls record, per parameter, the partial sums of the effective-descent
    metrics in ``last_edq`` (keyed by parameter); with it False a step does no
    extra work. A parameter listed in ``edq_segments`` (as ``(label, start, stop)``
    ranges of its flattened elements, as for DeepSpeed's flat partitions) gets one row
    of partial sums per range instead. ``edq_view_dtype`` measures the realised
    change in that dtype: the weight the model sees when the optimizer is handed fp32
    masters directly. ``step_chunk_numel`` bounds the elements a step works on at a
    time where it works in chunks (the trainer sizes it with ``chunk_numel_for``).
    ``flat_pieces`` says, for a flat tensor that holds pieces of several model tensors (a
    ZeRO partition), where they lie (``FlatPieces``), for an optimizer that keeps
    statistics per model tensor (``ScaledAdamW``'s scales); the others ignore it.
    """

    step_chunk_numel: int = MAX_CHUNK_NUMEL
    _track_edq: bool = False
    edq_view_dtype: torch.dtype | None = None
    unshaped_state: tuple[str, ...] = ("step",)  # state entries not shaped like the param
    # The state entry holding a bf16 weight's low part (the full-precision value is the
    # weight plus it: Collage's dtheta, a Kahan compensation), or None.
    low_part: str | None = None
    # Asked before a step changes anything (set by the ZeRO engine around DeepSpeed's step:
    # engine.base.GateOnce): False leaves everything as it was; a 0-d bool device tensor
    # becomes ``step_mask`` for the step.
    step_gate: Callable[[], bool | torch.Tensor] | None = None
    # Whether ``step`` honours ``step_mask`` (below); the optimizers that do set it True.
    masks_on_device: bool = False
    # A 0-d bool tensor on the parameters' device, or None: where it holds False the step
    # changes nothing (weights, state, EDQ sums all zero) though it runs, so that whether a
    # step applies can be decided on the device without the host reading it (the step
    # guard, collage_train/run/guard.py). Integer step counts still advance: the caller that
    # learns later that the step was refused takes them back (``rewind_steps``).
    step_mask: torch.Tensor | None = None

    @property
    def track_edq(self) -> bool:
        return self._track_edq

    @track_edq.setter
    def track_edq(self, value: bool) -> None:
        if value:
            self.last_edq = {}
        self._track_edq = bool(value)

    def __init__(
        self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"invalid AdamW hyper-parameters: lr={lr}, eps={eps}, wd={weight_decay}"
            )
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.last_edq: dict[torch.Tensor, torch.Tensor] = {}
        self.edq_segments: dict[torch.Tensor, list[tuple[str, int, int]]] = {}
        self.flat_pieces: dict[torch.Tensor, FlatPieces] = {}

    def ordered_params(self) -> list[torch.Tensor]:
        """Every parameter, in ``param_groups`` order (the order of the weight lists)."""
        return [param for group in self.param_groups for param in group["params"]]

    def scale_metrics(self) -> dict[str, float]:
        """Statistics of how the state's values are scaled, logged with each step (Scalify's
        ``ScaledAdamW`` reports its rescales); none for unscaled state."""
        return {}

    @torch.no_grad()
    def full_precision_weights(self) -> list[torch.Tensor]:
        """New fp32 tensors holding the full-precision value of every parameter."""
        return [self._full_precision(param) for param in self.ordered_params()]

    @torch.no_grad()
    def load_full_precision_weights(self, values: Sequence[torch.Tensor]) -> None:
        """Set every parameter's full-precision value (fp32 tensors, ``param_groups`` order)."""
        params = self.ordered_params()
        if len(values) != len(params):
            raise ValueError(f"expected {len(params)} weight tensors, got {len(values)}")
        for param, value in zip(params, values, strict=True):
            if value.shape != param.shape:
                raise ValueError(
                    f"weight of shape {tuple(value.shape)} given for a parameter of shape "
                    f"{tuple(param.shape)}"
                )
            self.load_full_precision_weight(param, value)

    @torch.no_grad()
    def load_full_precision_weight(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set one parameter's full-precision value, whether or not ``param_groups`` lists it
        now (ZeRO-3 lists its flat master partitions there only during a step)."""
        self._load_full_precision(param, value.to(param.device, torch.float32))

    def _full_precision(self, param: torch.Tensor) -> torch.Tensor:
        """The weight plus its low part where the state holds one (``low_part``), in fp32;
        the weight alone otherwise (fp32 weights, or bf16 with nothing beside it)."""
        value = param.detach().to(torch.float32, copy=True)
        low = self.state[param].get(self.low_part) if self.low_part else None
        if low is not None:
            value += low.float()
        return value

    def _load_full_precision(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Round ``value`` into the parameter (round to nearest even for bf16) and, where
        the state holds a low part, keep ``value`` minus that rounding in it."""
        param.detach().copy_(value)
        if self.low_part is None:
            return
        low = self._state_for(param).get(self.low_part)
        if low is not None:
            low.copy_(value - param.detach().float())

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, created at its first use (``low_part`` optimizers)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no low part")

    def _require_bf16_params(self, why: str) -> None:
        """Refuse parameters that are not bf16, saying why this optimizer needs them."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype != torch.bfloat16:
                    raise TypeError(
                        f"{type(self).__name__} {why} and needs bf16 parameters, got a "
                        f"{param.dtype} parameter of shape {tuple(param.shape)}; cast the "
                        "model with model.to(torch.bfloat16)"
                    )

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mask = self.step_mask
        if self.step_gate is not None:
            decision = self.step_gate()
            if not torch.is_tensor(decision):
                if not decision:
                    return loss
            elif mask is None:
                mask = decision
        if mask is not None and not self.masks_on_device:
            raise TypeError(f"{type(self).__name__} cannot mask its step on the device")
        previous, self.step_mask = self.step_mask, mask
        try:
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    self._step_group(group, params)
        finally:
            self.step_mask = previous
        return loss

    def rewind_steps(self, count: int) -> None:
        """Take back ``count`` steps from every parameter's integer step count: steps that
        ran under a ``step_mask`` that turned out False changed nothing else."""
        for state in self.state.values():
            if "step" in state:
                state["step"] -= count

    @abc.abstractmethod
    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Update ``params`` (those of ``group`` that have gradients) in place."""

    def _record_edq(
        self,
        params: list[torch.Tensor],
        before: list[torch.Tensor] | None,
        updates: list[torch.Tensor],
        dthetas: list[torch.Tensor] | None = None,
    ) -> None:
        if before is None:
            return
        lows = dthetas if dthetas is not None else [None] * len(params)
        view = self.edq_view_dtype
        for param, old, update, low in zip(params, before, updates, lows, strict=True):
            after = self._model_view(param)
            if view is not None and after.dtype != view:
                old, after = old.to(view), after.to(view)
            segments = self.edq_segments.get(param)
            if segments is None:
                self.last_edq[param] = edq_partials(old, after, update, low)
                continue
            if not segments:
                self.last_edq[param] = torch.zeros(0, len(FIELDS), device=after.device)
                continue
            old, after, update = old.flatten(), after.flatten(), update.flatten()
            low = low.flatten() if low is not None else None
            self.last_edq[param] = torch.stack(
                [
                    edq_partials(
                        old[start:stop],
                        after[start:stop],
                        update[start:stop],
                        low[start:stop] if low is not None else None,
                    )
                    for _, start, stop in segments
                ]
            )

    def _apply_tracked(
        self,
        params: list[torch.Tensor],
        targets: list[torch.Tensor],
        updates: list[torch.Tensor],
    ) -> None:
        """``targets += updates`` and each bf16 weight refreshed from its master (where
        the target is a master, not the weight itself), recording every parameter's EDQ
        partials as ``_record_edq`` does, ``step_chunk_numel`` elements at a time.

        Elementwise, so the weights are the same bits as one ``_foreach_add_``; but the
        copy of the weights before the update, their ``edq_view_dtype`` roundings and
        the partials' fp32 temporaries exist for one chunk instead of a whole tensor (a
        whole flat partition under ZeRO).
        """
        for param, target, update in zip(params, targets, updates, strict=True):
            weight = param.detach()
            if not all(t.is_contiguous() for t in (weight, target, update)):
                before = weight.clone()  # no flat views: as it is, in one piece
                target.add_(update)
                if target is not param:
                    weight.copy_(target)
                self._record_edq([param], [before], [update])
                continue
            sums = self._edq_sums(param)
            flat_w, flat_t, flat_u = weight.view(-1), target.view(-1), update.view(-1)
            for start, stop in self._chunks(weight.numel()):
                self._apply_chunk(flat_w, flat_t, flat_u[start:stop], start, sums)
            self._keep_edq(param, sums)

    def _edq_sums(self, param: torch.Tensor) -> EdqSums | None:
        """Zeroed EDQ partial sums for ``param`` (measured in ``edq_view_dtype``, a row per
        ``edq_segments`` range) when descent is tracked, else None."""
        if not self.track_edq:
            return None
        segments = self.edq_segments.get(param)
        return EdqSums(segments, param.numel(), self.edq_view_dtype, param.device)

    def _keep_edq(self, param: torch.Tensor, sums: EdqSums | None) -> None:
        """Record ``param``'s EDQ partial sums of this step (``last_edq``), if tracked."""
        if sums is not None:
            rows = sums.rows()
            if self.step_mask is not None:  # whatever a step summed, a refused one has none
                rows = torch.where(self.step_mask, rows, 0.0)
            self.last_edq[param] = rows

    def _pieces(
        self,
        tensors: Sequence[torch.Tensor | None],
        chunks: list[tuple[int, int]] | None = None,
    ) -> Iterator[tuple[int, list[torch.Tensor | None]]]:
        """``(start, pieces)`` of one tensor's step: the same ``[start, stop)`` range of each
        of ``tensors`` (the weight first; None entries stay None), flattened, for each of
        ``chunks`` (default ``_chunks``); tensors not all contiguous come whole, as they
        are (start 0). Elementwise steps give the same bits either way."""
        if not all(t is None or t.is_contiguous() for t in tensors):
            yield 0, list(tensors)
            return
        flat = [t.view(-1) if t is not None else None for t in tensors]
        for start, stop in self._chunks(flat[0].numel()) if chunks is None else chunks:
            yield start, [t[start:stop] if t is not None else None for t in flat]

    @staticmethod
    def _apply_chunk(
        flat_weight: torch.Tensor,
        flat_target: torch.Tensor,
        update: torch.Tensor,
        start: int,
        sums: EdqSums | None,
        mask: torch.Tensor | None = None,
    ) -> None:
        """``target[start:start + len(update)] += update``, the weight refreshed from it
        where the target is a master, and (``sums`` given) the chunk's EDQ partials added;
        with a ``mask`` (``step_mask``) that holds False, nothing changes and the partials
        are zero."""
        stop = start + update.numel()
        old = flat_weight[start:stop].clone() if sums is not None else None
        if mask is None:
            flat_target[start:stop].add_(update)
        else:
            update = torch.where(mask, update, 0.0)
            commit_(flat_target[start:stop], flat_target[start:stop] + update, mask)
        if flat_target.data_ptr() != flat_weight.data_ptr():
            commit_(flat_weight[start:stop], flat_target[start:stop], mask)
        if sums is not None:
            sums.add(start, old, flat_weight[start:stop], update)

    def _chunks(self, numel: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges of at most ``step_chunk_numel`` elements covering ``numel``."""
        return chunk_ranges(numel, self.step_chunk_numel)

    def edq_metrics(self) -> dict[str, float]:
        """EDQ metrics of the last tracked step over all its parameters ({} if none), with
        the dtheta terms where the state holds a low part (``low_part``)."""
        if not self.last_edq:
            return {}
        with_dtheta = self.low_part is not None and any(
            self.low_part in self.state[p] for p in self.last_edq
        )
        total = sum(p.reshape(-1, len(FIELDS)).sum(dim=0) for p in self.last_edq.values())
        return edq_metrics(total, with_dtheta)

    def _model_view(self, param: torch.Tensor) -> torch.Tensor:
        """The weight the model computes with, as ``_record_edq`` measures it: the
        parameter itself (Scalify's ScaledAdamW: a scaled parameter's value)."""
        return param.detach()

    def _snapshot(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Copies of the weights before an update, only when descent is tracked."""
        if not self.track_edq:
            return None
        return [self._model_view(p).clone() for p in params]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state without torch's cast of every state tensor to the param dtype.

        The base class would round fp32 masters and moments to bf16; here each tensor
        keeps the dtype it was saved with, is copied, and moves to the param's device.
        """
        saved_state = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in saved_state.items():
            param = params[int(index)]
            restored = {}
            for key, value in saved.items():
                if torch.is_tensor(value):
                    if key not in self.unshaped_state and value.shape != param.shape:
                        raise ValueError(
                            f"optimizer state {key!r} has shape {tuple(value.shape)} but its "
                            f"parameter has shape {tuple(param.shape)}"
                        )
                    value = value.to(param.device, copy=True)
                restored[key] = value
            self.state[param] = restored
