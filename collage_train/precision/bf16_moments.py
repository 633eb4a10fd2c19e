"""bf16_moments: bf16 weights and compute, fp32 master weights, bf16 AdamW moments.

The mixed-precision baseline with its moments halved (DeepSpeed's
``bf16_optimizer_states``; DeepSeek-V3 trains with bf16 moments): the update is computed
in fp32 from the moments' fp32 values and applied to the fp32 master; only the stored
moments are rounded to bf16. 12 bytes per parameter, as ``collage_plus``.
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import MasterForm

BF16_MOMENTS = register(
    PrecisionStrategy(
        name="bf16_moments",
        summary="bf16 weights and compute, fp32 master weights, bf16 AdamW moments",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=torch.float32,
        expected_state_bytes_per_param=12,  # theta 2 + grad 2 + master 4 + m 2 + v 2
        checkpoint_holds=("bf16 weights", "fp32 master", "bf16 exp_avg", "bf16 exp_avg_sq"),
        optimizer_state=(("exp_avg", 2), ("exp_avg_sq", 2)),
        optimizer=OptimizerSpec("adamw", moments="bf16"),
        state_form=MasterForm(torch.bfloat16),
    )
)
