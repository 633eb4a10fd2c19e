"""Which implementation of the Collage step a run uses: eager reference or compiled kernel.

``optim.kernel=auto`` runs the fused step (one pass per tensor: the C kernel of
``cpu_kernel`` on CPU, the Triton kernel on GPU, TorchInductor elsewhere) when its
compiler is there (a C compiler on CPU, Triton on GPU), the model is large enough for
the one-off build to pay for itself, and the fused kernel reproduces the eager
reference bit for bit on this device (checked once per process by
``compiled_matches_eager``: compilers and torch versions differ in their roundings).
Any failure of the probe (a build error, a Triton compile or launch error, a driver
error) makes ``auto`` fall back to the eager step with one warning line; ``compiled``
insists, and fails with one error line where the check, the build or the launch fails;
``eager`` forces the reference.
Strategies without a Collage step (fp32 masters) always run eagerly. The 8-bit-moment
Collage step (``Collage8bitAdamW``, mode ``EIGHT_BIT_MODE``) has fused kernels on CPU
(``eight_bit_kernel``) and CUDA (``eight_bit_triton``); elsewhere ``auto`` runs it
eagerly and ``compiled`` refuses.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil

import torch

from collage_train.errors import ConfigError, first_line
from collage_train.metrics.edq import partials_close
from collage_train.optim.collage.cpu_kernel import KernelBuildError, c_compiler
from collage_train.optim.collage.step_math import (
    collage_tensor_step,
    fused_tensor_step,
    step_scalars,
)

KERNEL_SETTINGS = ("auto", "compiled", "eager")
# The fused-step "mode" of Collage8bitAdamW (OptimizerSpec.fused_mode of collage_8bit)
EIGHT_BIT_MODE = "light_blockwise8"
AUTO_COMPILE_MIN_PARAMS = 20_000_000
# The parity probe: a size that is no multiple of any vector or block width, enough
# steps for the bias corrections and the compensation terms to matter.
_PROBE_NUMEL = 4099
_PROBE_STEPS = 6
# The 8-bit step's probe: thread ranges and a partial last block (a 1-ulp difference in
# one operation shows in about one element in 1e6 steps: many elements, a few steps).
_EIGHT_BIT_PROBE_NUMEL = 2**16 + 100

log = logging.getLogger(__name__)


def compiler_available(device: torch.device) -> bool:
    """Whether the fused step for ``device`` can be built here (its compiler is there)."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device.type == "cpu":
        return c_compiler() is not None
    compilers = (os.environ.get("CXX", ""), "g++", "c++", "clang++")  # TorchInductor
    return any(name and shutil.which(name) for name in compilers)


@functools.cache
def compiled_matches_eager(mode: str, device_type: str) -> bool:
    """Whether the compiled step of ``mode`` equals the eager one bitwise on this device.

    Runs both on the same random bf16 state for a few steps, with and without the EDQ
    sums, and compares parameters, every state component (bitwise) and the sums (to
    fp32 rounding). The compilation it triggers is the one training would do anyway.
    """
    if mode == EIGHT_BIT_MODE:
        return _eight_bit_matches_eager(device_type)
    gen = torch.Generator().manual_seed(0)

    def bf16(scale: float) -> torch.Tensor:
        values = torch.randn(_PROBE_NUMEL, generator=gen) * scale
        return values.to(device=device_type, dtype=torch.bfloat16)

    theta, grads = bf16(0.05), [bf16(1e-2) for _ in range(_PROBE_STEPS)]
    # theta, dtheta, exp_avg, exp_avg_sq, dv for the eager and the compiled step
    runs = [[theta.clone()] + [torch.zeros_like(theta) for _ in range(4)] for _ in range(2)]
    steps = (
        functools.partial(collage_tensor_step, mode=mode),
        fused_tensor_step(mode, device_type),
    )
    for t in range(1, _PROBE_STEPS + 1):
        scalars = step_scalars(3e-3 * 0.97**t, 0.9, 0.999, 1e-8, 0.1, t)
        track = t % 2 == 0
        sums = []
        for (p, dtheta, m, v, dv), step in zip(runs, steps, strict=True):
            dtheta = dtheta if mode != "none" else None
            dv = dv if mode == "plus" else None
            grad = grads[t - 1]
            sums.append(step(p, dtheta, m, v, dv, grad, *scalars, track=track, return_update=False))
        if track and not partials_close(sums[0], sums[1]):
            return False
    return all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*runs, strict=True)
    )


def _eight_bit_matches_eager(device_type: str) -> bool:
    """``compiled_matches_eager`` for ``Collage8bitAdamW``: the fused and the eager step
    of the same state, a partial last block and a block of zero gradients included,
    with and without EDQ sums; weights, dtheta, codes and absmax compared bitwise."""
    from collage_train.optim.collage.eight_bit import Collage8bitAdamW

    gen = torch.Generator().manual_seed(0)
    numel = _EIGHT_BIT_PROBE_NUMEL
    start = (torch.randn(numel, generator=gen) * 0.05).to(device_type, torch.bfloat16)
    grads = []
    for _ in range(_PROBE_STEPS):  # magnitudes over six decades: v below the smallest code
        scale = 10.0 ** torch.randint(-6, 1, (numel,), generator=gen).float()
        grads.append(torch.randn(numel, generator=gen) * scale)
        grads[-1][256:512] = 0.0
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    optimizers = [
        Collage8bitAdamW([p], lr=3e-3, weight_decay=0.1, seed=7, kernel=kernel)
        for p, kernel in zip(params, ("eager", "compiled"), strict=True)
    ]
    for t, grad in enumerate(grads, start=1):
        sums = []
        for param, optimizer in zip(params, optimizers, strict=True):
            param.grad = grad.to(device_type, torch.bfloat16)
            optimizer.track_edq = t % 2 == 0
            optimizer.step()
            sums.append(optimizer.last_edq.get(param))
        if t % 2 == 0 and not partials_close(sums[0], sums[1]):
            return False
    states = [optimizer.state[param] for param, optimizer in zip(params, optimizers, strict=True)]
    pairs = [(params[0].detach(), params[1].detach())]
    pairs += [
        (value, states[1][name]) for name, value in states[0].items() if torch.is_tensor(value)
    ]
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)


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
