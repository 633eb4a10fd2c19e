"""Collage (Yu et al., ICML 2024, arXiv 2405.03637) in one place: an AdamW whose whole
state is bf16, with the bits that bf16 rounding would drop kept as multi-component floats.

Where each part of the paper lives:

============================================  ==============================================
paper                                         file
============================================  ==============================================
MCF arithmetic: Fast2Sum, TwoSum, TwoProd,    ``mcf.py``, bf16 operations only, each
Grow, Mul (Algorithms 1-3)                    rounded once
one Collage-light / Collage-plus AdamW step   ``step_math.py`` (``collage_tensor_step``): the
on one tensor (Algorithm 4), every rounding   eager reference, and the host-side constants
explicit                                      (bias corrections from an integer step, beta2's
                                              bf16 remainder in float64)
the optimizer: modes none / light / plus,     ``adamw.py`` (``CollageAdamW``, a drop-in for
state layout, EDQ tracking                    ``torch.optim.AdamW`` on bf16 parameters)
the same step fused into one pass (the        ``cpu_kernel.py`` + ``cpu_kernel.c`` (CPU) and
paper's 192 -> 22 B/param of traffic)         ``triton_kernel.py`` (CUDA), bitwise equal to
                                              the eager step
which step a run uses, and the parity probe   ``kernels.py`` (``optim.kernel=auto|eager|
a fused kernel passes before first use        compiled``)
light's weight with 8-bit blockwise moments   ``eight_bit.py`` (``Collage8bitAdamW``, with
(the paper's 8-bit extension)                 its fused kernels and its parity probe)
============================================  ==============================================

The precision strategies that select it (``collage_light``, ``collage_plus``, and ``bf16``
as mode "none") are records in ``collage_train/precision/``; the EDQ formulas are in
``collage_train/metrics/edq.py``. Nothing here imports the trainer, the engines or
the strategies.
"""

from collage_train.optim.collage.adamw import CollageAdamW
from collage_train.optim.collage.eight_bit import Collage8bitAdamW  # registers its probe

__all__ = ["Collage8bitAdamW", "CollageAdamW"]
