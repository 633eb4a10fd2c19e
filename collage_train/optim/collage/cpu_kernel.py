"""The fused CollageAdamW step on CPU: a small C kernel, built once per machine.

``cpu_kernel.c`` does one pass over each tensor (EDQ sums in the same pass) with the
arithmetic of ``step_math.collage_tensor_step``, bitwise: fast tiers that leave out
roundings check block by block that this did not matter and hand a block that fails on,
down to an exact tier (``checked_blocks`` and ``exact_blocks`` count the blocks handed
on). It is compiled on first use with the system C compiler (``-march=native``, no FMA
contraction), cached under ``$COLLAGE_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/collage_train/kernels``) keyed by source, compiler, flags and
processor, and loaded with ctypes. Tensors are split over ``torch.get_num_threads()``
threads, each range's sums added in range order: results do not depend on timing.

The tiers, the cache and why not TorchInductor: docs/strategies.md,
'The fused Collage step: CPU and Triton kernels'.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import torch

from collage_train.optim.collage.step_math import StepScalars

_MODES = {"none": 0, "light": 1, "plus": 2}
# Blocks the kernel handed from its fastest tier to the checked one, and to the exact
# one, since the process started.
_handed = [0, 0]
_SOURCE = "cpu_kernel.c"
# Below this many elements one thread does the whole tensor (a thread hand-off costs
# tens of microseconds); ranges are multiples of 64 elements (a cache line of bf16 x 2).
_SPLIT_MIN_NUMEL = 1 << 16
_RANGE_ALIGN = 64
# Where the kernel has its split-rounding tier (it reads the x86 MXCSR flags).
_X86_64 = platform.machine().lower() in ("x86_64", "amd64")


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded here."""


class _Scalars(ctypes.Structure):
    """``scalars_t`` of cpu_kernel.c: these ``StepScalars`` fields, in this order, fp32."""

    NAMES = (
        "one_minus_beta1",
        "beta2",
        "beta2_hi",
        "beta2_lo",
        "one_minus_beta2",
        "inv_sqrt_bias2",
        "eps",
        "step_size",
        "decay",
    )
    _fields_ = [(name, ctypes.c_float) for name in NAMES]


def c_compiler() -> str | None:
    """The C compiler the kernel is built with, or None when there is none."""
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _flags() -> list[str]:
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd"]
    if _X86_64:
        flags.append("-mprefer-vector-width=512")  # AVX-512 where there is one
    return [*flags, "-fPIC", "-shared"]


def _processor_identity() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def splits_roundings() -> bool:
    """Whether the kernel has its split-rounding tier here (x86-64 processors)."""
    return _X86_64


def checked_blocks() -> int:
    """How many blocks the split-rounding tier (x86) handed on in this process.

    Each is a block of 1024 elements where the processor flagged a rounding of that
    tier (a subnormal or huge operand); the result is the same either way, only
    slower. Mostly zero in training.
    """
    return _handed[0]


def exact_blocks() -> int:
    """How many blocks went to the exact tier in this process.

    Each is a block of 1024 elements where a rounding the fast tiers leave out was not
    the identity (subnormal second moments, say); the result is the same either way,
    only slower. Mostly zero in training.
    """
    return _handed[1]


def cache_dir() -> Path:
    """Where built kernels are kept (``$COLLAGE_KERNEL_CACHE`` overrides)."""
    if override := os.environ.get("COLLAGE_KERNEL_CACHE"):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "collage_train" / "kernels"


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (once per machine) and load the kernel; KernelBuildError when that fails."""
    library = build_library(_SOURCE)
    _declare(library)
    return library


def build_library(source_name: str) -> ctypes.CDLL:
    """Compile ``source_name`` (a C file of this package) with this module's flags into the
    cache, once per source, compiler and processor, and load it; KernelBuildError when
    that fails. The kernels of this package all build this way."""
    compiler = c_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc or clang)")
    source = resources.files("collage_train.optim.collage").joinpath(source_name).read_bytes()
    flags = _flags()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (version, *flags, _processor_identity())) + source
    ).hexdigest()[:20]
    target = cache_dir() / f"{Path(source_name).stem}-{key}.so"
    if not target.exists():
        try:
            _build(compiler, flags, source, target, source_name)
        except OSError as error:
            raise KernelBuildError(f"could not build into {target.parent}: {error}") from error
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise KernelBuildError(f"could not load {target}: {error}") from error


def _declare(library: ctypes.CDLL) -> None:
    """The C signature of ``collage_step``, for ctypes."""
    library.collage_step.restype = None
    library.collage_step.argtypes = [
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        *[ctypes.c_void_p] * 7,
        ctypes.POINTER(_Scalars),
        ctypes.POINTER(ctypes.c_double),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_void_p,
    ]


def _build(
    compiler: str, flags: list[str], source: bytes, target: Path, name: str = _SOURCE
) -> None:
    """Compile ``source`` (file ``name``) into ``target`` through a private temporary
    directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / name
        src.write_bytes(source)
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, str(src), "-o", str(built)], capture_output=True, text=True
        )
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            raise KernelBuildError(f"{Path(compiler).name} failed on {name}: {first}")
        os.replace(built, target)  # atomic: concurrent ranks never load a partial file


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="collage-cpu")


def _ranges(n: int, workers: int) -> list[tuple[int, int]]:
    if n < _SPLIT_MIN_NUMEL or workers == 1:
        return [(0, n)]
    size = -(-n // workers)
    size = -(-size // _RANGE_ALIGN) * _RANGE_ALIGN
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def cpu_tensor_step(mode: str) -> Callable[..., torch.Tensor | None]:
    """The fused step of ``mode`` for contiguous CPU bf16 tensors.

    Same positional tensors and ``StepScalars`` as ``step_math.collage_tensor_step``
    (1-D), ``track``, ``return_update`` and ``mask`` as keywords; returns the six EDQ
    partial sums (fp32) or the intended update. Raises KernelBuildError when the kernel
    cannot be built.
    """
    library, mode_id = load_library(), _MODES[mode]

    def step(
        theta: torch.Tensor,
        dtheta: torch.Tensor | None,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        dv: torch.Tensor | None,
        grad: torch.Tensor,
        scalars: StepScalars,
        *,
        track: bool,
        return_update: bool,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        tensors = (theta, dtheta, exp_avg, exp_avg_sq, dv, grad)
        for tensor in tensors:
            if tensor is not None and (
                tensor.dtype != torch.bfloat16
                or tensor.device.type != "cpu"
                or not tensor.is_contiguous()
                or tensor.numel() != theta.numel()
            ):
                raise ValueError("the CPU Collage kernel takes contiguous bf16 CPU tensors")
        if (mode_id > 0 and dtheta is None) or (mode_id == 2 and dv is None):
            raise ValueError(f"mode {mode!r} needs its dtheta (and dv in plus) state")
        if mask is not None and (mask.dtype != torch.bool or mask.device.type != "cpu"):
            raise ValueError("the CPU Collage kernel's mask is a bool CPU tensor")
        # zeroed where a False mask leaves it unwritten (the kernel reads the mask itself)
        new_update = torch.empty_like if mask is None else torch.zeros_like
        update = new_update(theta) if track and return_update else None
        keep = mask.data_ptr() if mask is not None else None
        out = 0 if not track else (2 if return_update else 1)
        c_scalars = _Scalars(*scalars.pick(_Scalars.NAMES))
        pointers = [t.data_ptr() if t is not None else None for t in (*tensors, update)]

        def run(bounds: tuple[int, int]) -> tuple[list[float], list[int]]:
            start, end = bounds
            sums, handed = (ctypes.c_double * 6)(), (ctypes.c_int64 * 2)()
            shifted = [p + 2 * start if p is not None else None for p in pointers]
            library.collage_step(end - start, mode_id, out, *shifted, c_scalars, sums, handed, keep)
            return list(sums), list(handed)

        ranges = _ranges(theta.numel(), torch.get_num_threads())
        if len(ranges) == 1:
            results = [run(ranges[0])]
        else:
            results = list(_pool(len(ranges)).map(run, ranges))
        for _, handed in results:
            _handed[0] += handed[0]
            _handed[1] += handed[1]
        partials = [sums for sums, _ in results]
        if update is not None:
            return update
        if not track:
            return None
        sums = [sum(column) for column in zip(*partials, strict=True)]
        return torch.tensor(sums, dtype=torch.float32)

    return step
