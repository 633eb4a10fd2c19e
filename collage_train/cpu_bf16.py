"""bf16 matrix products as fp32 GEMMs on CPUs whose native bf16 GEMM is slow.

A bf16 GEMM on a GPU (or with AMX) multiplies the bf16 operands exactly, accumulates in
fp32 and rounds the result to bf16 once: the same arithmetic is an fp32 GEMM on the
exactly up-cast operands followed by one round-to-nearest-even cast. ``Bf16GemmsAsFp32``
does that below autograd (forward and backward products; model code untouched) for
``mm``, ``addmm``, ``bmm``, ``baddbmm`` and the CPU flash attention forward and backward;
only the accumulation order differs from a native bf16 GEMM. ``train.cpu_bf16_gemm``:
``native`` keeps torch's kernels, ``fp32`` emulates, ``auto`` times one bf16 GEMM against
its emulation at start-up and takes the faster. CUDA runs and runs without bf16 compute
are never affected; a compiled model (``train.compile=true``) gets the same arithmetic
from decompositions given to TorchInductor (``compile_backend``).
Why, which CPUs, what it costs: docs/design.md, "bf16 products on CPUs without fast bf16".
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from collage_train.errors import ConfigError

SETTINGS = ("auto", "native", "fp32")
_PROBE_SIZE = 256  # an n x n x n GEMM: milliseconds on the slow path, microseconds otherwise
_PROBE_REPEATS = 3
aten = torch.ops.aten


def _round_output(out: Any) -> Any:
    return out.to(torch.bfloat16)


def _round_output_keep_lse(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    attention, *rest = out  # (output, logsumexp): the native kernel keeps lse in fp32
    return (attention.to(torch.bfloat16), *rest)


def _round_all(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(torch.bfloat16) for t in out)


# op -> how its fp32 outputs become what the native bf16 kernel returns
_EMULATED: dict[Any, Callable[[Any], Any]] = {
    aten.mm.default: _round_output,
    aten.addmm.default: _round_output,
    aten.bmm.default: _round_output,
    aten.baddbmm.default: _round_output,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _round_output_keep_lse,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _round_all,
}


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    return value


def _emulates(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call is a bf16 CPU product: first operand bf16, every tensor on CPU."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return (
        bool(tensors)
        and tensors[0].dtype == torch.bfloat16
        and all(t.device.type == "cpu" for t in tensors)
    )


def emulated_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` computed in fp32 on the up-cast bf16 operands, rounded as the native one."""
    upcast_args = tuple(_upcast(a) for a in args)
    upcast_kwargs = {k: _upcast(v) for k, v in kwargs.items()}
    return _EMULATED[func](func(*upcast_args, **upcast_kwargs))


class Bf16GemmsAsFp32(TorchDispatchMode):
    """While active, bf16 CPU products run as fp32 GEMMs rounded once to bf16."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _EMULATED and _emulates(args, kwargs):
            return emulated_call(func, args, kwargs)
        return func(*args, **kwargs)


def _decomposition(func: Any) -> Callable[..., Any]:
    def decompose(*args: Any, **kwargs: Any) -> Any:
        if not _emulates(args, kwargs):
            return NotImplemented  # leave fp32 (and non-CPU) products to Inductor
        return emulated_call(func, args, kwargs)

    return decompose


def compile_backend() -> Callable[..., Any]:
    """A ``torch.compile`` backend: TorchInductor with bf16 CPU products as fp32 GEMMs."""
    # Inductor's own entry point and decomposition table (private, stable since torch 2.0).
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    decompositions = {**select_decomp_table(), **{op: _decomposition(op) for op in _EMULATED}}

    def inductor_with_fp32_gemms(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(graph, example_inputs, decompositions=decompositions)

    return inductor_with_fp32_gemms


def _best_seconds(fn: Callable[[], Any]) -> float:
    fn()  # warm-up: kernel selection, first allocation
    best = float("inf")
    for _ in range(_PROBE_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def probe_gflops() -> tuple[float, float]:
    """(native bf16, emulated) GFLOP/s of one n x n x n GEMM on one core, best of three.

    One thread: ranks that share a host probe at the same moment, and a multi-threaded
    GEMM on oversubscribed cores can run 100x slower than it would alone.
    """
    gen = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=gen).to(torch.bfloat16) for _ in range(2)
    )
    flops = 2 * _PROBE_SIZE**3 / 1e9
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        native = _best_seconds(lambda: torch.mm(a, b))
        emulated = _best_seconds(lambda: torch.mm(a.float(), b.float()).to(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)
    return flops / native, flops / emulated


@dataclass(frozen=True)
class CpuBf16Gemm:
    """How this run computes bf16 products on the CPU, and why.

    ``mode`` is ``native`` (torch's kernels), ``fp32`` (emulated) or ``n/a`` (a CUDA
    run, or a strategy without bf16 compute); the GFLOP/s are the start-up probe's,
    None where ``auto`` did not run it.
    """

    setting: str
    mode: str
    reason: str
    native_gflops: float | None = None
    emulated_gflops: float | None = None

    @property
    def emulates(self) -> bool:
        return self.mode == "fp32"

    def context(self, compiled: bool) -> contextlib.AbstractContextManager[Any]:
        """Around forward and backward: the dispatch mode, unless Inductor does the work."""
        if self.emulates and not compiled:
            return Bf16GemmsAsFp32()
        return contextlib.nullcontext()

    def compile_backend(self) -> str | Callable[..., Any]:
        """What ``model.compile(backend=...)`` takes for this choice."""
        return compile_backend() if self.emulates else "inductor"

    def describe(self) -> str:
        return f"bf16 GEMMs: {self.mode} ({self.reason})"

    def summary(self) -> dict[str, Any]:
        return {
            "cpu_bf16_gemm": self.mode,
            "cpu_bf16_gemm_setting": self.setting,
            "cpu_bf16_gemm_probe_gflops": (
                {"native_bf16": self.native_gflops, "fp32_emulated": self.emulated_gflops}
                if self.native_gflops is not None
                else None
            ),
        }


def choose_cpu_bf16_gemm(
    setting: str,
    device: torch.device,
    computes_in_bf16: bool,
    probe: Callable[[], tuple[float, float]] | None = None,
) -> CpuBf16Gemm:
    """Resolve ``train.cpu_bf16_gemm`` for a run on ``device`` (``probe``: ``probe_gflops``)."""
    setting = str(setting)
    if setting not in SETTINGS:
        raise ConfigError(
            f"train.cpu_bf16_gemm must be one of {', '.join(SETTINGS)}, got {setting!r}"
        )
    if device.type != "cpu":
        return CpuBf16Gemm(setting, "n/a", f"{device.type} runs its own kernels")
    if not computes_in_bf16:
        return CpuBf16Gemm(setting, "n/a", "this precision computes no bf16 products")
    if setting != "auto":
        return CpuBf16Gemm(setting, setting, f"train.cpu_bf16_gemm={setting}")
    native, emulated = (probe or probe_gflops)()
    mode = "fp32" if emulated > native else "native"
    reason = f"auto: native bf16 {native:.1f} GFLOP/s, as fp32 {emulated:.1f} GFLOP/s"
    return CpuBf16Gemm(setting, mode, reason, native, emulated)
