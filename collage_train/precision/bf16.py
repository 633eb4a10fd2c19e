"""bf16: weights, gradients and AdamW moments all in bf16, the paper's (16,16) setting.

Cheapest in memory and fastest, but an update smaller than about 2^-9 of its weight
is lost to rounding, and with beta2 = 0.999 the second moment never decays.
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import PlainForm

BF16 = register(
    PrecisionStrategy(
        name="bf16",
        summary="bf16 weights, gradients and AdamW moments (no master copy)",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=8,  # theta 2 + grad 2 + m 2 + v 2
        checkpoint_holds=("bf16 weights", "bf16 exp_avg", "bf16 exp_avg_sq"),
        optimizer_state=(("exp_avg", 2), ("exp_avg_sq", 2)),
        optimizer=OptimizerSpec("collage", "none"),
        state_form=PlainForm(torch.bfloat16, torch.bfloat16),
    )
)
