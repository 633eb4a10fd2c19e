"""The Triton kernel of Collage8bitAdamW (optim/collage/eight_bit_triton) without a GPU:
bitwise against the eager step in Triton's CPU interpreter (both of its rounding
branches, tests/optim/triton_interpreted_8bit.py), and compiled ahead of time for sm_80 and
sm_90 to PTX that keeps the arithmetic exact (tests/optim/test_triton_ptx.py's checks). On a
GPU, tests/optim/test_collage_8bit_kernel.py runs the real kernel against the eager step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")  # a dev dependency; absent only off Linux x86-64

from ptx_checks import violations  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from collage_train.optim.collage.eight_bit_triton import (  # noqa: E402
    NUM_WARPS,
    ROWS,
    _eight_bit_kernel,
)

_POINTERS = {
    "mq_ptr": "*u8",
    "vq_ptr": "*u8",
    "cells_ptr": "*i32",
    "theta_ptr": "*bf16",
    "dtheta_ptr": "*bf16",
    "g_ptr": "*bf16",
    "keep_ptr": "*i1",
}


def compile_ptx(track: bool, capability: int, gated: bool = False, **options) -> str:
    """PTX of the kernel as the optimizer launches it (blocks of 256) for sm_<capability>."""
    constexprs = {"QBLOCK": 256, "ROWS": ROWS, "TRACK": track, "GATED": gated, "R": False}

    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return _POINTERS.get(name, "*fp32")
        return {"n": "i32", "key1": "u32", "key2": "i32"}.get(name, "fp32")

    signature = {name: kind(name) for name in _eight_bit_kernel.arg_names}
    source = ASTSource(fn=_eight_bit_kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": NUM_WARPS, "enable_fp_fusion": False, **options},
    )
    return compiled.asm["ptx"]


@pytest.mark.slow
def test_triton_kernel_is_bitwise_the_eager_step_in_the_interpreter():
    script = Path(__file__).with_name("triton_interpreted_8bit.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bitwise equal" in done.stdout


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.slow
def test_the_kernel_compiles_to_exact_ptx(capability, gated):
    """The tracked variant (a superset of the untracked one's arithmetic), with and
    without the step guard's mask."""
    ptx = compile_ptx(True, capability, gated)
    assert f".target sm_{capability}" in ptx
    assert violations(ptx) == []
    assert re.search(r"\bdiv\.rn\.f32\b", ptx) and re.search(r"\bsqrt\.rn\.f32\b", ptx)
    assert re.search(r"\bcvt\.rn\.bf16(x2)?\.f32\b", ptx)


def test_the_check_catches_a_contracted_multiply_add():
    ptx = compile_ptx(False, 90, enable_fp_fusion=True)
    assert "fused multiply-add" in violations(ptx)
