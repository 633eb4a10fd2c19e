"""Precision strategies, selected by name with ``precision=NAME``.

Importing this package registers the built-in strategies; ``get_strategy`` looks one
up and ``available`` lists them.
"""

from collage_train.precision import (  # noqa: F401  (registration)
    adamw_8bit,
    bf16,
    bf16_kahan,
    bf16_moments,
    bf16_sr,
    collage_8bit,
    collage_light,
    collage_plus,
    fp32,
    mixed_fp32,
    scalify,
    split_fp32,
)
from collage_train.precision.base import (
    PrecisionStrategy,
    available,
    get_strategy,
    register,
    strategy_for,
)

__all__ = ["PrecisionStrategy", "available", "get_strategy", "register", "strategy_for"]
