"""collage_8bit: Collage's compensated weight (theta, dtheta) with 8-bit blockwise moments.

The weight is Collage-light's multi-component float (Yu et al., ICML 2024), so small
updates and weight decay are not lost; the moments are 8-bit blockwise codes with an fp32
scale per 256 elements (as ``adamw_8bit``), the second moment rounded stochastically
between its two nearest codes so that beta2 = 0.999's slow decay survives in expectation
(``docs/strategies.md`` derives the choice and its error bound). 8 bytes per parameter
plus the scales: the bytes of ``bf16``, with the weight's small updates kept.
"""

import torch

from collage_train.precision.adamw_8bit import SCALE_BYTES
from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import BlockwiseForm, CompensatedForm

COLLAGE_8BIT = register(
    PrecisionStrategy(
        name="collage_8bit",
        summary="Collage (theta, dtheta) bf16 weights with 8-bit blockwise AdamW moments",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        # theta 2 + grad 2 + dtheta 2 + m 1 + v 1, and an fp32 scale per 256 of each moment
        expected_state_bytes_per_param=8 + 2 * SCALE_BYTES,
        checkpoint_holds=(
            "bf16 weights",
            "bf16 dtheta",
            "8-bit exp_avg with fp32 block scales",
            "8-bit exp_avg_sq with fp32 block scales",
        ),
        optimizer_state=(
            ("dtheta", 2),
            ("exp_avg", 1),
            ("exp_avg_sq", 1),
            ("exp_avg_absmax", SCALE_BYTES),
            ("exp_avg_sq_absmax", SCALE_BYTES),
        ),
        optimizer=OptimizerSpec("collage", "light", moments="blockwise8"),
        state_form=BlockwiseForm(CompensatedForm("dtheta")),
    )
)
