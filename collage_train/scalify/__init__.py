"""Scalify (Balanca et al., 2024): power-of-two scales carried beside tensors.

``scale`` holds the scale arithmetic and propagation rules, ``float8`` the clamped
float8 casts and scaled matmuls (hardware or exact emulation), ``adamw`` an AdamW
whose moments (and optionally master weights) are stored as scaled fp16, and
``modules`` (imported on its own, it needs transformers) a scaled drop-in for
``nn.Linear`` / ``Conv1D`` with E4M3 forward and E5M2 backward matmuls.
"""

from collage_train.scalify.adamw import ScaledAdamW
from collage_train.scalify.float8 import (
    FLOAT8_BACKWARD,
    FLOAT8_FORWARD,
    float8_matmul,
    scaled_mm,
    scaled_mm_emulated,
    to_float8,
)
from collage_train.scalify.scale import (
    add_scale,
    is_power_of_two,
    matmul_scale,
    mul_scale,
    pow2_floor,
    rms_scale,
    sum_scale,
)

__all__ = [
    "FLOAT8_BACKWARD",
    "FLOAT8_FORWARD",
    "ScaledAdamW",
    "add_scale",
    "float8_matmul",
    "is_power_of_two",
    "matmul_scale",
    "mul_scale",
    "pow2_floor",
    "rms_scale",
    "scaled_mm",
    "scaled_mm_emulated",
    "sum_scale",
    "to_float8",
]
