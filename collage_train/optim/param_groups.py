"""Split a model's parameters into weight-decayed matrices and undecayed vectors."""

from __future__ import annotations

from typing import Any

import torch

from collage_train.model.shapes import full_shape


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear and embedding weights) only, not on norms or biases
    (by the shape the model gives them, also for a ZeRO-3 shard: ``full_shape``)."""
    matrices, vectors = [], []
    for param in model.parameters():
        if param.requires_grad:
            (matrices if len(full_shape(param)) >= 2 else vectors).append(param)
    return [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
