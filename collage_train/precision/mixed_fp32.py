"""mixed_fp32: bf16 weights and compute, fp32 master weights and AdamW moments.

The usual mixed-precision baseline, the paper's (16,32) setting: the model computes
in bf16; the optimizer applies each update to an fp32 master copy and rounds it
into the bf16 weight.
"""

import torch

from collage_train.precision.base import PrecisionStrategy, register
from collage_train.precision.state_form import MasterForm

MIXED_FP32 = register(
    PrecisionStrategy(
        name="mixed_fp32",
        summary="bf16 weights and compute, fp32 master weights and AdamW moments",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=torch.float32,
        expected_state_bytes_per_param=16,  # theta 2 + grad 2 + master 4 + m 4 + v 4
        checkpoint_holds=("bf16 weights", "fp32 master", "fp32 exp_avg", "fp32 exp_avg_sq"),
        optimizer_state=(("exp_avg", 4), ("exp_avg_sq", 4)),
        state_form=MasterForm(torch.float32),
    )
)
