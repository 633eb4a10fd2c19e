"""What the project's optimizers share: exact state restore and descent tracking."""

from __future__ import annotations

from typing import Any

import torch

from collage_train.metrics.descent import descent_metrics, descent_partials


class TrackingOptimizer(torch.optim.Optimizer):
    """Base of the AdamW family.

    ``track_descent = True`` makes the next ``step`` record, per parameter, the partial
    sums of the effective-descent metrics in ``last_descent`` (keyed by parameter);
    with it False a step does no extra work.
    """

    track_descent: bool = False

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.last_descent: dict[torch.Tensor, torch.Tensor] = {}

    def _record_descent(
        self,
        params: list[torch.Tensor],
        before: list[torch.Tensor] | None,
        updates: list[torch.Tensor],
        dthetas: list[torch.Tensor] | None = None,
    ) -> None:
        if before is None:
            return
        lows = dthetas if dthetas is not None else [None] * len(params)
        for param, old, update, low in zip(params, before, updates, lows, strict=True):
            self.last_descent[param] = descent_partials(old, param.detach(), update, low)

    def descent_metrics(self) -> dict[str, float]:
        """EDQ metrics of the last tracked step over all its parameters ({} if none)."""
        if not self.last_descent:
            return {}
        with_dtheta = any("dtheta" in self.state[p] for p in self.last_descent)
        return descent_metrics(sum(self.last_descent.values()), with_dtheta)

    def _snapshot(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Copies of the weights before an update, only when descent is tracked."""
        if not self.track_descent:
            return None
        return [p.detach().clone() for p in params]

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
                    if key != "step" and value.shape != param.shape:
                        raise ValueError(
                            f"optimizer state {key!r} has shape {tuple(value.shape)} but its "
                            f"parameter has shape {tuple(param.shape)}"
                        )
                    value = value.to(param.device, copy=True)
                restored[key] = value
            self.state[param] = restored
