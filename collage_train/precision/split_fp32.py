"""split_fp32: mixed_fp32's exact numerics with the fp32 master split around the weight.

The master weight is stored as the bf16 model weight plus a 16-bit remainder (the idea
behind Megatron/Transformer Engine's ``store_param_remainders``), and the moments are
fp32, so every step is bit for bit the fp32-master AdamW step of ``mixed_fp32``: 14
bytes per parameter instead of 16.

Trade-off against Collage: collage_plus needs 12 bytes but is approximate (its MCF
weight and second moment carry about 2^-16 relative error, and m is bf16);
split_fp32 is exact and costs 2 bytes more. Holding m in bf16 would bring split_fp32
to 12 bytes too, but then it would no longer be the fp32-master trajectory.
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import SplitForm

SPLIT_FP32 = register(
    PrecisionStrategy(
        name="split_fp32",
        summary="exact fp32 master as bf16 weight + 16-bit remainder, fp32 moments",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=14,  # theta 2 + grad 2 + remainder 2 + m 4 + v 4
        checkpoint_holds=(
            "bf16 weights",
            "int16 master remainder (+ tie indices)",
            "fp32 exp_avg",
            "fp32 exp_avg_sq",
        ),
        optimizer_state=(("remainder", 2), ("exp_avg", 4), ("exp_avg_sq", 4)),
        optimizer=OptimizerSpec("split_master"),
        state_form=SplitForm(),
    )
)
