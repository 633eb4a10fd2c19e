"""Which implementation of the Collage step a run uses: eager reference or compiled kernel.

``optim.kernel=auto`` compiles the step (one fused TorchInductor kernel per tensor) when
a compiler backend is there (a C++ compiler on CPU, Triton on GPU) and the model is
large enough for the one-off compilation (seconds per mode) to pay for itself;
``compiled`` insists, ``eager`` forces the reference. Both give bitwise-identical
results.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from collage_train.errors import ConfigError

KERNEL_SETTINGS = ("auto", "compiled", "eager")
AUTO_COMPILE_MIN_PARAMS = 20_000_000


def compiler_available(device: torch.device) -> bool:
    """Whether TorchInductor can build kernels for ``device`` here."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    compilers = (os.environ.get("CXX", ""), "g++", "c++", "clang++")
    return any(name and shutil.which(name) for name in compilers)


def choose_kernel(setting: str, device: torch.device, num_params: int) -> str:
    """``eager`` or ``compiled`` for ``optim.kernel=setting``."""
    if setting not in KERNEL_SETTINGS:
        raise ConfigError(
            f"optim.kernel must be one of {', '.join(KERNEL_SETTINGS)}, got {setting!r}"
        )
    if setting == "eager":
        return "eager"
    available = compiler_available(device)
    if setting == "compiled":
        if not available:
            needs = "Triton" if device.type == "cuda" else "a C++ compiler (g++ or clang++)"
            raise ConfigError(
                f"optim.kernel=compiled needs {needs} for {device.type}; install it or use "
                "optim.kernel=eager"
            )
        return "compiled"
    return "compiled" if available and num_params >= AUTO_COMPILE_MIN_PARAMS else "eager"
