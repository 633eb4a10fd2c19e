"""adamw_8bit: bf16 weights and compute, fp32 master weights, 8-bit blockwise AdamW moments.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022;
bitsandbytes' ``AdamW8bit``): each moment is stored as one byte per element, a code
into a dynamic quantisation map, with one fp32 scale (the block's absolute maximum) per
block of 256 elements. 10 bytes per parameter plus the scales (2 x 4/256). The
blocks run over the flat tensor the optimizer steps, which under ZeRO is this rank's
partition; a checkpoint reshards through the whole-tensor form of its blocks
(``checkpoint.whole_tensor``).
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import BlockwiseForm, MasterForm

BLOCK = 256
SCALE_BYTES = 4 / BLOCK  # one fp32 absmax per block, per moment

ADAMW_8BIT = register(
    PrecisionStrategy(
        name="adamw_8bit",
        summary="bf16 weights and compute, fp32 master weights, 8-bit blockwise AdamW moments",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=torch.float32,
        # theta 2 + grad 2 + master 4 + m 1 + v 1, and an fp32 scale per 256 of each moment
        expected_state_bytes_per_param=10 + 2 * SCALE_BYTES,
        checkpoint_holds=(
            "bf16 weights",
            "fp32 master",
            "8-bit exp_avg with fp32 block scales",
            "8-bit exp_avg_sq with fp32 block scales",
        ),
        optimizer_state=(
            ("exp_avg", 1),
            ("exp_avg_sq", 1),
            ("exp_avg_absmax", SCALE_BYTES),
            ("exp_avg_sq_absmax", SCALE_BYTES),
        ),
        optimizer=OptimizerSpec("adamw", moments="blockwise8"),
        state_form=BlockwiseForm(MasterForm(torch.float32)),
    )
)
