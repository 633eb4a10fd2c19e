"""Collage (Yu et al., ICML 2024, arXiv 2405.03637) in one place: an AdamW whose whole
state is bf16, with the bits that bf16 rounding would drop kept as multi-component floats.

``mcf.py`` holds the MCF arithmetic (Fast2Sum, TwoSum, TwoProd, Grow, Mul), bf16
operations only; ``step_math.py`` one Collage step on one tensor, every rounding
explicit (the eager reference); ``adamw.py`` the optimizer ``CollageAdamW`` (modes
none / light / plus); ``cpu_kernel.py`` + ``cpu_kernel.c`` and ``triton_kernel.py`` the
same step fused into one pass, bitwise equal to the eager step; ``kernels.py`` which
step a run uses (``optim.kernel``); ``eight_bit.py`` ``Collage8bitAdamW``, light's weight
with 8-bit blockwise moments. Nothing here imports the trainer, the engines or the
strategies (``collage_train/precision/`` selects it).

Where each part of the paper lives: docs/strategies.md,
'Where each part of the paper lives'.
"""

from collage_train.optim.collage.adamw import CollageAdamW
from collage_train.optim.collage.eight_bit import Collage8bitAdamW  # registers its probe

__all__ = ["Collage8bitAdamW", "CollageAdamW"]
