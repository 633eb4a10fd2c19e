"""collage_light: bf16 everything, with the weight held as an MCF (theta, dtheta).

The update's bits that bf16 rounding would drop are kept in dtheta and fed back at the
next step, so small updates and weight decay still move the model. The second moment
stays plain bf16; the authors pair light with beta2 = 0.98.
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import CompensatedForm

COLLAGE_LIGHT = register(
    PrecisionStrategy(
        name="collage_light",
        summary="Collage-light: bf16 state, weights compensated as (theta, dtheta)",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=10,  # theta 2 + grad 2 + m 2 + v 2 + dtheta 2
        checkpoint_holds=("bf16 weights", "bf16 dtheta", "bf16 exp_avg", "bf16 exp_avg_sq"),
        optimizer_state=(("dtheta", 2), ("exp_avg", 2), ("exp_avg_sq", 2)),
        optimizer=OptimizerSpec("collage", "light"),
        state_form=CompensatedForm("dtheta"),
    )
)
