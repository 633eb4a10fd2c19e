"""Which implementation of the Collage step a run uses: eager reference or compiled kernel.

``optim.kernel=auto`` runs the fused step when its compiler is there, the model is large
enough for the one-off build to pay for itself, and the fused kernel reproduces the
eager reference bit for bit on this device (checked once per process by
``compiled_matches_eager``); any failure of that probe falls back to the eager step with
one warning line. ``compiled`` insists, and fails with one error line where the check,
the build or the launch fails; ``eager`` forces the reference. Strategies without a
Collage step always run eagerly. The 8-bit-moment step (``EIGHT_BIT_MODE``) has fused
kernels on CPU and CUDA only: elsewhere ``auto`` runs it eagerly and ``compiled`` refuses.

Details: docs/strategies.md, "Choosing the step: optim.kernel".
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable

import torch

from collage_train.errors import ConfigError, first_line
from collage_train.metrics.edq import partials_close
from collage_train.optim.collage.cpu_kernel import KernelBuildError, c_compiler, cpu_tensor_step
from collage_train.optim.collage.step_math import (
    MIN_COMPILED_NUMEL,
    collage_tensor_step,
    compiled_tensor_step,
    step_scalars,
)

KERNEL_SETTINGS = ("auto", "compiled", "eager")
# The fused-step "mode" of Collage8bitAdamW (OptimizerSpec.fused_mode of collage_8bit)
EIGHT_BIT_MODE = "light_blockwise8"
AUTO_COMPILE_MIN_PARAMS = 20_000_000
# The parity probe: a size that is no multiple of any vector or block width, enough
# steps for the bias corrections and the compensation terms to matter.
_PROBE_NUMEL = 4099
PROBE_STEPS = 6
# The 8-bit step's probe: thread ranges and a partial last block (a 1-ulp difference in
# one operation shows in about one element in 1e6 steps: many elements, a few steps).
EIGHT_BIT_PROBE_NUMEL = 2**16 + 100

log = logging.getLogger(__name__)


def compiler_available(device: torch.device) -> bool:
    """Whether the fused step for ``device`` can be built here (its compiler is there)."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device.type == "cpu":
        return c_compiler() is not None
    compilers = (os.environ.get("CXX", ""), "g++", "c++", "clang++")  # TorchInductor
    return any(name and shutil.which(name) for name in compilers)


def fused_tensor_step(mode: str, device_type: str):
    """The one-pass step of ``mode`` for tensors on ``device_type``.

    CUDA runs the hand-written Triton kernel (``triton_kernel``), the CPU the C kernel
    (``cpu_kernel``), other devices the TorchInductor compilation of
    ``collage_tensor_step``. Same arguments as ``compiled_tensor_step``.
    """
    if device_type == "cuda":
        from collage_train.optim.collage.triton_kernel import triton_tensor_step

        return triton_tensor_step(mode)
    if device_type == "cpu":
        return cpu_tensor_step(mode)
    return compiled_tensor_step(mode)


def min_fused_numel(device_type: str) -> int:
    """Tensors smaller than this are stepped eagerly (compiling for them would not pay)."""
    return 1 if device_type in ("cuda", "cpu") else MIN_COMPILED_NUMEL


# The parity probe of a fused mode whose optimizer is not CollageAdamW, by mode: given a
# device type, whether its fused step equals its eager step bitwise. Registered by the
# module that defines the optimizer (``eight_bit.py`` for EIGHT_BIT_MODE), which the
# package imports, so that this module imports none of them.
PARITY_PROBES: dict[str, Callable[[str], bool]] = {}


def register_parity_probe(mode: str, probe: Callable[[str], bool]) -> None:
    """Use ``probe`` as ``compiled_matches_eager``'s check for ``mode``."""
    PARITY_PROBES[mode] = probe
    compiled_matches_eager.cache_clear()


@functools.cache
def compiled_matches_eager(mode: str, device_type: str) -> bool:
    """Whether the compiled step of ``mode`` equals the eager one bitwise on this device.

    Runs both on the same random bf16 state for a few steps, with and without the EDQ
    sums, and compares parameters, every state component (bitwise) and the sums (to
    fp32 rounding). The compilation it triggers is the one training would do anyway.
    """
    if mode in PARITY_PROBES:
        return PARITY_PROBES[mode](device_type)
    if mode == EIGHT_BIT_MODE:  # its probe lives with its optimizer (eight_bit.py)
        raise RuntimeError(
            "the 8-bit step's parity probe is registered by "
            "collage_train.optim.collage.eight_bit, which is not imported"
        )
    gen = torch.Generator().manual_seed(0)

    def bf16(scale: float) -> torch.Tensor:
        values = torch.randn(_PROBE_NUMEL, generator=gen) * scale
        return values.to(device=device_type, dtype=torch.bfloat16)

    theta, grads = bf16(0.05), [bf16(1e-2) for _ in range(PROBE_STEPS)]
    # theta, dtheta, exp_avg, exp_avg_sq, dv for the eager and the compiled step
    runs = [[theta.clone()] + [torch.zeros_like(theta) for _ in range(4)] for _ in range(2)]
    steps = (
        functools.partial(collage_tensor_step, mode=mode),
        fused_tensor_step(mode, device_type),
    )
    for t in range(1, PROBE_STEPS + 1):
        scalars = step_scalars(3e-3 * 0.97**t, 0.9, 0.999, 1e-8, 0.1, t)
        track = t % 2 == 0
        sums = []
        for (p, dtheta, m, v, dv), step in zip(runs, steps, strict=True):
            dtheta = dtheta if mode != "none" else None
            dv = dv if mode == "plus" else None
            grad = grads[t - 1]
            sums.append(step(p, dtheta, m, v, dv, grad, scalars, track=track, return_update=False))
        if track and not partials_close(sums[0], sums[1]):
            return False
    return all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*runs, strict=True)
    )


def choose_kernel(setting: str, device: torch.device, num_params: int, mode: str | None) -> str:
    """``eager`` or ``compiled`` for ``optim.kernel=setting`` and Collage ``mode``.

    ``mode`` is the strategy's Collage mode (``none``/``light``/``plus``), or None for a
    strategy without a Collage step, which always runs eagerly.
    """
    if setting not in KERNEL_SETTINGS:
        raise ConfigError(
            f"optim.kernel must be one of {', '.join(KERNEL_SETTINGS)}, got {setting!r}"
        )
    if setting == "eager" or mode is None:
        return "eager"
    if setting == "auto" and num_params < AUTO_COMPILE_MIN_PARAMS:
        return "eager"
    if mode == EIGHT_BIT_MODE and device.type not in ("cpu", "cuda"):
        if setting == "auto":
            return "eager"
        raise ConfigError(
            f"optim.kernel=compiled: the 8-bit Collage step has fused kernels for CPU and "
            f"CUDA only, not {device.type}; use optim.kernel=eager or auto"
        )
    if not compiler_available(device):
        if setting == "auto":
            return "eager"
        needs = {"cuda": "Triton", "cpu": "a C compiler (gcc or clang)"}.get(
            device.type, "a C++ compiler (g++ or clang++)"
        )
        raise ConfigError(
            f"optim.kernel=compiled needs {needs} for {device.type}; install it or use "
            "optim.kernel=eager"
        )
    fused = {"cuda": "the Triton kernel", "cpu": "the C kernel"}.get(device.type, "TorchInductor")
    if mode == EIGHT_BIT_MODE:
        fused = "the 8-bit Triton kernel" if device.type == "cuda" else "the 8-bit C kernel"
    try:
        if compiled_matches_eager(mode, device.type):
            return "compiled"
        reason = (
            f"{fused} (torch {torch.__version__}) does not reproduce the eager Collage step "
            f"bit for bit on {device.type}"
        )
    except KernelBuildError as error:
        reason = f"{fused} could not be built: {first_line(error)}"
    except Exception as error:  # Triton compile/launch, driver or runtime errors alike
        reason = f"{fused} failed its start-up check ({type(error).__name__}: {first_line(error)})"
    if setting == "compiled":
        raise ConfigError(f"optim.kernel=compiled: {reason}; use optim.kernel=eager or auto")
    log.warning("%s: running the eager reference step instead", reason)
    return "eager"
