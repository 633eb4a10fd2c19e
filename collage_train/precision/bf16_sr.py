"""bf16_sr: bf16 weights, gradients and AdamW moments, the update rounded stochastically.

Ozkara et al., "Stochastic Rounding for LLM Training: Theory and Practice" (AISTATS
2025): the AdamW update is computed in fp32 and rounded into the bf16 weight up or down
with probabilities that make the rounding unbiased, so an update below half a bf16 ulp
moves the weight in expectation instead of never (torchao's
``AdamW(bf16_stochastic_round=True)``). The moments are bf16, rounded to nearest; with
beta2 = 0.999 the second moment sticks as it does under ``bf16``. 8 bytes per parameter,
the same as ``bf16``; the rounding's random bits are a hash of the seed, the tensor, the
step and the element (``optim.rounding_noise``), so a resumed run rounds as an
uninterrupted one.
"""

import torch

from collage_train.precision.base import OptimizerSpec, PrecisionStrategy, register
from collage_train.precision.state_form import PlainForm

BF16_SR = register(
    PrecisionStrategy(
        name="bf16_sr",
        summary="bf16 weights, gradients and AdamW moments; the update rounded stochastically",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_dtype=None,
        expected_state_bytes_per_param=8,  # theta 2 + grad 2 + m 2 + v 2
        checkpoint_holds=("bf16 weights", "bf16 exp_avg", "bf16 exp_avg_sq"),
        optimizer_state=(("exp_avg", 2), ("exp_avg_sq", 2)),
        optimizer=OptimizerSpec("stochastic_rounding"),
        state_form=PlainForm(torch.bfloat16, torch.bfloat16),
    )
)
