"""fp32: full-precision weights, gradients and AdamW state; the numerical reference."""

import torch

from collage_train.precision.base import PrecisionStrategy, register
from collage_train.precision.state_form import PlainForm

FP32 = register(
    PrecisionStrategy(
        name="fp32",
        summary="fp32 weights, gradients and AdamW moments",
        param_dtype=torch.float32,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=16,  # theta 4 + grad 4 + m 4 + v 4
        checkpoint_holds=("fp32 weights", "fp32 exp_avg", "fp32 exp_avg_sq"),
        optimizer_state=(("exp_avg", 4), ("exp_avg_sq", 4)),
        state_form=PlainForm(torch.float32, torch.float32),
    )
)
