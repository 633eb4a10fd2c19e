"""The planner's optimizer-step row checked against a measured step: the live-tensor peak of
one tracked step above the state (tests/planning/test_memory_plan.py,
tests/scalify/test_scalify_params.py)."""

from __future__ import annotations

import pytest
import torch

from collage_train.metrics.live_memory import LiveTensorBytes
from collage_train.planning.memory_plan import Setting, step_transient


def assert_step_temporaries_match_the_table(strategy, params, optimizer, masked=False) -> None:
    """A tracked step's live-tensor peak above the state (gradients set) is the planner's
    STEP_TRANSIENT row for the strategy's optimizer, within 10%."""
    optimizer.step()  # creates the state
    with LiveTensorBytes() as live:
        live.track_training_state(params, optimizer)
        live.track(p.grad for p in params)
        before = live.current
        optimizer.track_edq = True
        optimizer.step_mask = torch.tensor(True) if masked else None
        optimizer.step()
        optimizer.step_mask = None
    numel = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    setting = Setting(strategy, 0, fused_optimizer=False, masked_step=masked)
    per_param, per_largest = step_transient(setting)
    assert live.peak - before == pytest.approx(per_param * numel + per_largest * largest, rel=0.1)
