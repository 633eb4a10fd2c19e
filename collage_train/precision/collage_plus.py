"""collage_plus: Collage-light plus a compensated second moment (v, dv).

With beta2 = 0.999, bf16(beta2) is 1.0 and a plain bf16 v never decays; holding v as an
MCF and multiplying by the MCF (bf16(beta2), beta2 - bf16(beta2)) tracks it to about
2^-16 relative. Only v enters the square root.
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import CompensatedForm

COLLAGE_PLUS = register(
    PrecisionStrategy(
        name="collage_plus",
        summary="Collage-plus: bf16 state, weights as (theta, dtheta) and v as (v, dv)",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=12,  # light's 10 + dv 2
        checkpoint_holds=(
            "bf16 weights",
            "bf16 dtheta",
            "bf16 exp_avg",
            "bf16 exp_avg_sq",
            "bf16 dv",
        ),
        optimizer_state=(("dtheta", 2), ("exp_avg", 2), ("exp_avg_sq", 2), ("dv", 2)),
        optimizer=OptimizerSpec("collage", "plus"),
        state_form=CompensatedForm("dtheta", dv=True),
    )
)
