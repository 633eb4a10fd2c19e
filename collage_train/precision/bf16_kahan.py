"""bf16_kahan: bf16 weights and AdamW moments with a bf16 Kahan compensation buffer.

The bits of each update that bf16 rounding drops are kept in a bf16 buffer and added back
at the next step (Kahan summation; torch-optimi's ``AdamW(kahan_sum=True)``): 10 bytes per
parameter, as ``collage_light``, whose (theta, dtheta) pair does the same job with an
exact two-sum (``docs/strategies.md`` compares the two).
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import CompensatedForm

BF16_KAHAN = register(
    PrecisionStrategy(
        name="bf16_kahan",
        summary="bf16 weights, gradients and AdamW moments with a bf16 Kahan compensation",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=10,  # theta 2 + grad 2 + m 2 + v 2 + compensation 2
        checkpoint_holds=(
            "bf16 weights",
            "bf16 exp_avg",
            "bf16 exp_avg_sq",
            "bf16 Kahan compensation",
        ),
        optimizer_state=(("exp_avg", 2), ("exp_avg_sq", 2), ("kahan_comp", 2)),
        optimizer=OptimizerSpec("kahan"),
        state_form=CompensatedForm("kahan_comp", debiased=True),
    )
)
