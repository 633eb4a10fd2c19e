"""The Triton Collage kernel compiled ahead of time for real GPUs, without one.

``triton.compile`` with a CUDA ``GPUTarget`` runs the whole pipeline down to PTX (and
SASS, with the ptxas Triton ships) on a CPU machine. Every variant the optimizer can
launch (mode x EDQ tracking x update return, 32- and 64-bit element counts) is compiled
for sm_80 (A100) and sm_90 (H100), and its PTX must do what bitwise parity with the
eager reference needs (triton_kernel's docstring): correctly rounded division and
square root, no flush-to-zero, no fused multiply-add in fp32 (the eager kernels round
every product before an add), and round-to-nearest-even conversions to bf16.

On sm_80, LLVM narrows "bf16(fp32(a) op fp32(b))" for bf16 a, b to a bf16 add or
multiply, which that architecture spells ``fma.rn.bf16 d, a, 1.0, b`` (a difference:
-1.0) or ``fma.rn.bf16 d, a, b, -0.0``: one rounding of the exact sum or product, equal to
the reference's (fp32 has more than 2 x 8 + 2 bits, so rounding to fp32 first is
innocuous). A bf16 FMA is allowed only in these two forms.
"""

from __future__ import annotations

import itertools
import re

import pytest
from ptx_checks import violations

triton = pytest.importorskip("triton")  # a dev dependency; absent only off Linux x86-64

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from collage_train.optim.collage.triton_kernel import (  # noqa: E402
    _MODES,
    BLOCK,
    NUM_WARPS,
    _collage_step_kernel,
)

# (track, return_update) as the optimizer calls it -> the kernel's TRACK, WRITE_UPDATE
_CALLS = {(False, False): (False, False), (True, False): (True, False), (True, True): (False, True)}


def compile_ptx(
    mode: str,
    track: bool,
    write_update: bool,
    capability: int,
    n_type: str = "i32",
    gated: bool = False,
    **options,
) -> str:
    """PTX of one variant of the kernel for ``sm_<capability>``."""
    constexprs = {
        "MODE": _MODES[mode],
        "TRACK": track,
        "WRITE_UPDATE": write_update,
        "GATED": gated,
        "BLOCK": BLOCK,
        "R": False,  # the branch GPUs run: the conversion instruction rounds
    }

    def kind(name: str) -> str:  # as the launcher's arguments specialise
        if name in constexprs:
            return "constexpr"
        if name == "partials_ptr":
            return "*fp32"
        if name == "keep_ptr":
            return "*i1"
        if name.endswith("_ptr"):
            return "*bf16"
        return n_type if name == "n" else "fp32"  # the step's scalars

    signature = {name: kind(name) for name in _collage_step_kernel.arg_names}
    source = ASTSource(fn=_collage_step_kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": NUM_WARPS, "enable_fp_fusion": False, **options},
    )
    return compiled.asm["ptx"]


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("mode", ["none", "light", "plus"])
@pytest.mark.slow
def test_every_launched_variant_compiles_to_exact_ptx(mode, capability):
    for (track, write_update), gated in itertools.product(_CALLS.values(), (False, True)):
        ptx = compile_ptx(mode, track, write_update, capability, gated=gated)
        assert f".target sm_{capability}" in ptx
        assert violations(ptx) == [], (mode, track, write_update, gated)
        assert re.search(r"\bdiv\.rn\.f32\b", ptx) and re.search(r"\bsqrt\.rn\.f32\b", ptx)
        assert re.search(r"\bcvt\.rn\.bf16(x2)?\.f32\b", ptx)


def test_tensors_past_two_billion_elements_compile_too():
    ptx = compile_ptx("plus", True, False, 90, n_type="i64")
    assert violations(ptx) == []


def test_the_check_catches_a_contracted_multiply_add():
    """With fp fusion on (Triton's default), products contract into FMAs: refused."""
    ptx = compile_ptx("plus", False, False, 90, enable_fp_fusion=True)
    assert "fused multiply-add" in violations(ptx)
