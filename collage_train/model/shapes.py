"""A parameter's whole size, also where an engine keeps only this rank's shard of it.

DeepSpeed ZeRO-3 replaces a partitioned parameter's data with an empty tensor and keeps
its real shape as ``ds_shape`` (and ``ds_numel``); code that sizes or groups parameters
(parameter counts, FLOPs, weight-decay groups) reads these instead of ``.shape``.
"""

from __future__ import annotations

import torch


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's shape as the model defines it."""
    return getattr(param, "ds_shape", None) or param.shape


def full_numel(param: torch.Tensor) -> int:
    """The parameter's number of elements as the model defines it."""
    return int(getattr(param, "ds_numel", None) or param.numel())
