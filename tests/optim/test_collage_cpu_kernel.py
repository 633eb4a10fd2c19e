"""The C kernel of the CPU Collage step (optim/collage/cpu_kernel.py) against the eager reference.

Bitwise on parameters and every state component, over many steps, on sizes that split
across threads and sizes that do not, with gradients from 1e-38 (bf16 subnormals and
fp32-subnormal intermediates) to 1e4 and exact zeros; each of its tiers (the fastest on
training-like state, the checked one for blocks with subnormal operands, the exact one
for blocks where a rounding the fast tiers leave out is not the identity), the build
without the split tier, the exhaustive checks behind the tiers; its build cache and its
failures.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import torch

from collage_train.errors import ConfigError
from collage_train.metrics.edq import partials_close
from collage_train.optim.collage import cpu_kernel, kernels
from collage_train.optim.collage.step_math import collage_tensor_step, step_scalars

pytestmark = pytest.mark.skipif(
    cpu_kernel.c_compiler() is None, reason="needs a C compiler (gcc or clang)"
)

# 3 * 2**16 + 5: split into thread ranges, none a multiple of the vector width.
SIZES = [1, 7, 2049, 3 * 2**16 + 5]


def state(mode: str, n: int, seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    theta = (torch.randn(n, generator=gen) * 0.05).bfloat16()
    zeros = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(4)]
    dtheta, m, v, dv = zeros
    return [theta, dtheta if mode != "none" else None, m, v, dv if mode == "plus" else None]


def gradient(n: int, step: int, gen: torch.Generator) -> torch.Tensor:
    """Magnitudes cycling over 1e-38..1e4 per element, some exact zeros."""
    exponent = torch.randint(-38, 5, (n,), generator=gen).double()
    values = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0**exponent
    values[torch.rand(n, generator=gen) < 0.05] = 0.0
    return values.to(torch.bfloat16)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def tier_counts() -> tuple[int, int]:
    """Blocks handed so far to the checked tier and to the exact tier."""
    return cpu_kernel.checked_blocks(), cpu_kernel.exact_blocks()


def handed_since(before: tuple[int, int]) -> tuple[int, int]:
    """Blocks handed to the checked tier and to the exact tier since ``before``."""
    checked, exact = tier_counts()
    return checked - before[0], exact - before[1]


X86 = cpu_kernel.splits_roundings()


def agrees_with_eager(mode: str, n: int, beta2: float) -> bool:
    """Twelve steps of random gradients on eager and kernel, bitwise equal after each;
    whether the second moments went subnormal on the way."""
    eager, fused = state(mode, n, 0), state(mode, n, 0)
    kernel = cpu_kernel.cpu_tensor_step(mode)
    gen = torch.Generator().manual_seed(1)
    seen_subnormal = False
    for step in range(1, 13):
        grad = gradient(n, step, gen)
        scalars = step_scalars(3e-3 * 0.97**step, 0.9, beta2, 1e-8, 0.1, step)
        track, keep = step % 3 == 0, step % 4 == 0
        expected = collage_tensor_step(
            *eager, grad, scalars, mode=mode, track=track, return_update=keep
        )
        got = kernel(*fused, grad, scalars, track=track, return_update=keep)
        if track and keep:
            assert torch.equal(bits(got), bits(expected)), step
        elif track:
            assert partials_close(got, expected), (step, got, expected)
        else:
            assert got is None
        for a, b in zip(eager, fused, strict=True):
            if a is not None:
                assert torch.equal(bits(a), bits(b)), step
        tiny = eager[3].float().abs()
        seen_subnormal |= bool(((tiny > 0) & (tiny < 2.0**-126)).any())
    return seen_subnormal


@pytest.mark.parametrize("mode", ["none", "light", "plus"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("beta2", [0.999, 0.95])  # bf16(0.999) = 1: 0.95 has a real product
def test_kernel_is_bitwise_equal_to_the_eager_reference(mode, n, beta2):
    seen_subnormal = agrees_with_eager(mode, n, beta2)
    if n > 1000:  # the second moment of the smallest gradients went subnormal
        assert seen_subnormal


@pytest.fixture(scope="module")
def no_split_library(tmp_path_factory) -> ctypes.CDLL:
    """The kernel built as for a processor without the split tier (-DCOLLAGE_NO_SPLIT)."""
    source = resources.files("collage_train.optim.collage").joinpath("cpu_kernel.c").read_bytes()
    target = tmp_path_factory.mktemp("no-split") / "cpu_kernel-no-split.so"
    cpu_kernel._build(
        cpu_kernel.c_compiler(), [*cpu_kernel._flags(), "-DCOLLAGE_NO_SPLIT"], source, target
    )
    library = ctypes.CDLL(str(target))
    cpu_kernel._declare(library)
    return library


@pytest.fixture
def without_split_tier(monkeypatch, no_split_library):
    monkeypatch.setattr(cpu_kernel, "load_library", lambda: no_split_library)


@pytest.mark.parametrize("mode", ["none", "light", "plus"])
@pytest.mark.slow
def test_the_build_without_the_split_tier_is_bitwise_equal_too(without_split_tier, mode):
    before = tier_counts()
    assert agrees_with_eager(mode, 2049, 0.95)
    assert tier_counts()[0] == before[0]  # nothing went through a split tier


def training_like_state(mode: str, n: int, beta2: float) -> list[torch.Tensor | None]:
    """The state after 20 eager steps with gradients of 1e-4 to 1e-1, no subnormals."""
    tensors = state(mode, n, 0)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 21):
        grad = (
            torch.randn(n, generator=gen) * 10.0 ** -torch.randint(1, 5, (n,), generator=gen)
        ).bfloat16()
        collage_tensor_step(
            *tensors, grad, step_scalars(1e-3, 0.9, beta2, 1e-8, 0.1, step), mode=mode, track=False
        )
    return tensors


def steps_agree(mode: str, eager: list, fused: list, beta2: float, seed: int) -> None:
    """Three more steps (untracked, tracked, update kept) on both: bitwise equal."""
    kernel = cpu_kernel.cpu_tensor_step(mode)
    gen = torch.Generator().manual_seed(seed)
    n = eager[0].numel()
    for step, (track, keep) in enumerate([(False, False), (True, False), (True, True)], 21):
        grad = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
        scalars = step_scalars(1e-3, 0.9, beta2, 1e-8, 0.1, step)
        expected = collage_tensor_step(
            *eager, grad, scalars, mode=mode, track=track, return_update=keep
        )
        got = kernel(*fused, grad, scalars, track=track, return_update=keep)
        if keep:
            assert torch.equal(bits(got), bits(expected)), step
        elif track:
            assert partials_close(got, expected), (step, got, expected)
        for a, b in zip(eager, fused, strict=True):
            if a is not None:
                assert torch.equal(bits(a), bits(b)), step


@pytest.mark.parametrize("mode", ["none", "light", "plus"])
@pytest.mark.parametrize("beta2", [0.999, 0.95])
def test_training_like_state_stays_on_the_fast_path(mode, beta2):
    """No block recomputed, results bitwise equal: the fast path is what runs and is right."""
    n = 8 * 1024 + 7
    eager = training_like_state(mode, n, beta2)
    fused = [t.clone() if t is not None else None for t in eager]
    before = tier_counts()
    steps_agree(mode, eager, fused, beta2, seed=3)
    assert tier_counts() == before  # none left the fastest tier


@pytest.mark.parametrize("mode", ["light", "plus"])
@pytest.mark.parametrize("beta2", [0.999, 0.95])
def test_a_block_with_an_inexact_skipped_rounding_is_recomputed_exactly(mode, beta2):
    """Remainders ten times their values in block 3 only (Fast2Sum's precondition broken):
    that block, and no other, goes to the exact path, and every bit still matches."""
    n = 8 * 1024
    eager = training_like_state(mode, n, beta2)
    gen = torch.Generator().manual_seed(4)
    block = slice(3 * 1024, 4 * 1024)
    theta, dtheta, _, v, dv = eager
    dtheta[block] = (theta[block].float() * 10 * torch.rand(1024, generator=gen)).bfloat16()
    if dv is not None:
        dv[block] = (v[block].float() * 10 * torch.rand(1024, generator=gen) + 1e-6).bfloat16()
    fused = [t.clone() if t is not None else None for t in eager]
    before = tier_counts()
    steps_agree(mode, eager, fused, beta2, seed=5)
    # The first step puts the remainders back in range, so only it hands the block on,
    # through the checked tier (which skips the same roundings) where there is a split one.
    checked, exact = handed_since(before)
    assert (checked, exact) == (int(X86), 1)


def with_subnormal_first_moments(mode: str, n: int, beta2: float) -> list[torch.Tensor | None]:
    """Training-like state whose block 2 has first moments decayed to bf16 subnormals (the
    rows of an embedding whose tokens stopped appearing)."""
    tensors = training_like_state(mode, n, beta2)
    exp_avg = tensors[2]
    block = exp_avg[2 * 1024 : 3 * 1024]
    block.copy_((torch.sign(block.float()) * 2.0**-130).bfloat16())
    return tensors


@pytest.mark.parametrize("mode", ["light", "plus"])
@pytest.mark.parametrize("beta2", [0.999, 0.95])
def test_a_block_with_subnormal_operands_runs_on_the_checked_tier(mode, beta2):
    """The split rounding of m sees a subnormal operand, the processor flags it, and that
    block alone is handed to the checked tier (whose integer rounding handles
    subnormals); nothing reaches the exact tier and every bit matches."""
    eager = with_subnormal_first_moments(mode, 8 * 1024, beta2)
    fused = [t.clone() if t is not None else None for t in eager]
    before = tier_counts()
    steps_agree(mode, eager, fused, beta2, seed=6)
    checked, exact = handed_since(before)
    assert (checked, exact) == (int(X86), 0)  # one step: then the moments are normal


LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
FE_INVALID, FE_TONEAREST, FE_UPWARD = 0x01, 0x000, 0x800  # x86 <fenv.h>


@pytest.mark.skipif(not X86, reason="the split tier and MXCSR are x86-64 only")
@pytest.mark.slow
def test_without_round_to_nearest_the_split_tier_is_left_out(monkeypatch, no_split_library):
    """Veltkamp's splitting rounds to nearest only in round-to-nearest mode (and needs
    denormals seen, not zeroed): in any other MXCSR mode the kernel does what the build
    without the split tier does, bit for bit."""
    n = 8 * 1024
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 1e-2).bfloat16()
    scalars = step_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 21)
    with_split = training_like_state("plus", n, 0.95)
    without = [t.clone() for t in with_split]
    split_kernel = cpu_kernel.cpu_tensor_step("plus")
    monkeypatch.setattr(cpu_kernel, "load_library", lambda: no_split_library)
    plain_kernel = cpu_kernel.cpu_tensor_step("plus")
    before = tier_counts()
    assert LIBM.fesetround(FE_UPWARD) == 0
    try:
        split_kernel(*with_split, grad, scalars, track=False, return_update=False)
        plain_kernel(*without, grad, scalars, track=False, return_update=False)
    finally:
        LIBM.fesetround(FE_TONEAREST)
    assert tier_counts()[0] == before[0]  # no block tried the split tier
    for a, b in zip(with_split, without, strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.skipif(not X86, reason="the split tier and MXCSR are x86-64 only")
def test_the_kernel_leaves_the_callers_floating_point_flags_as_it_found_them():
    """The split tier clears MXCSR's sticky flags to read its own; a flag the caller had
    raised before the call is raised after it."""
    fused = with_subnormal_first_moments("plus", 8 * 1024, 0.95)  # raises flags inside
    grad = torch.full((8 * 1024,), 1e-2, dtype=torch.bfloat16)
    kernel = cpu_kernel.cpu_tensor_step("plus")
    scalars = step_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 21)
    before = tier_counts()
    LIBM.feraiseexcept(FE_INVALID)
    kernel(*fused, grad, scalars, track=False, return_update=False)
    raised = LIBM.fetestexcept(FE_INVALID)
    LIBM.feclearexcept(FE_INVALID)
    assert tier_counts()[0] == before[0] + 1  # the split tier ran and flagged a block
    assert raised


def test_each_thread_range_counts_once():
    """The sums over a split tensor count every element once (nonzero = n)."""
    n = 3 * 2**16 + 5
    theta, dtheta, m, v, dv = state("plus", n, 3)
    grad = torch.full((n,), 1e-2, dtype=torch.bfloat16)
    sums = cpu_kernel.cpu_tensor_step("plus")(
        theta, dtheta, m, v, dv, grad, step_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1),
        track=True, return_update=False,
    )  # fmt: skip
    assert sums.dtype == torch.float32
    assert sums[2].item() == n


def test_refuses_tensors_it_cannot_step():
    kernel = cpu_kernel.cpu_tensor_step("plus")
    theta, dtheta, m, v, dv = state("plus", 8, 0)
    scalars = step_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="contiguous bf16 CPU"):
        kernel(theta, dtheta, m, v, dv, theta.float(), scalars, track=False, return_update=False)
    with pytest.raises(ValueError, match="needs its dtheta"):
        kernel(theta, dtheta, m, v, None, theta, scalars, track=False, return_update=False)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; restored afterwards."""
    monkeypatch.setenv("COLLAGE_KERNEL_CACHE", str(tmp_path / "kernels"))
    cpu_kernel.load_library.cache_clear()
    kernels.compiled_matches_eager.cache_clear()
    yield tmp_path / "kernels"
    cpu_kernel.load_library.cache_clear()
    kernels.compiled_matches_eager.cache_clear()


@pytest.mark.slow
def test_builds_once_into_the_cache(fresh_build):
    cpu_kernel.load_library()
    built = list(fresh_build.glob("cpu_kernel-*.so"))
    assert len(built) == 1
    assert [p.name for p in fresh_build.iterdir()] == [built[0].name]  # no leftovers
    stamp = built[0].stat().st_mtime_ns
    cpu_kernel.load_library.cache_clear()
    cpu_kernel.load_library()
    assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_a_failing_compiler_is_one_clear_error(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # exits 1 on anything
    with pytest.raises(cpu_kernel.KernelBuildError, match=r"false failed on cpu_kernel\.c"):
        cpu_kernel.load_library()
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"could not be built.*optim\.kernel=eager"):
        kernels.choose_kernel("compiled", cpu, 10, "plus")
    assert kernels.choose_kernel("auto", cpu, 10**9, "plus") == "eager"
    assert "could not be built" in caplog.text
    assert not list(fresh_build.glob("*.so"))


def test_an_unwritable_cache_is_one_clear_error(fresh_build, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("COLLAGE_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.raises(cpu_kernel.KernelBuildError, match="could not build into"):
        cpu_kernel.load_library()
    assert kernels.choose_kernel("auto", torch.device("cpu"), 10**9, "light") == "eager"


def test_scalars_reach_the_kernel_as_fp32():
    """1 - beta2 is formed in float64 and rounded once to fp32, as torch does a scalar."""
    field = dict(cpu_kernel._Scalars._fields_)["one_minus_beta2"]
    assert field is ctypes.c_float
    value = cpu_kernel._Scalars(*[0.0] * 4, 1.0 - 0.999, *[0.0] * 4).one_minus_beta2
    assert value == float(torch.tensor(1.0 - 0.999, dtype=torch.float32))
    assert not math.isclose(value, 1.0 - 0.999, rel_tol=1e-12)


def run_exhaustive_check(name: str, tmp_path: Path) -> None:
    """Build tests/<name>.c with the kernel's flags and run it, one slice per core at once:
    each slice finds nothing wrong and exits 0, and the slices cover all 2^16 chunks."""
    source = Path(__file__).with_name(f"{name}.c")
    kernel_dir = Path(cpu_kernel.__file__).parent
    flags = [f for f in cpu_kernel._flags() if f not in ("-fPIC", "-shared")]
    binary = tmp_path / name
    subprocess.run(
        [cpu_kernel.c_compiler(), *flags, f"-I{kernel_dir}", str(source), "-o", str(binary)],
        check=True,
    )
    slices = min(8, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else 1
    processes = [
        subprocess.Popen([str(binary), str(k), str(slices)], stdout=subprocess.PIPE, text=True)
        for k in range(slices)
    ]
    try:
        outcomes = [(p.communicate(timeout=600)[0].split(), p.returncode) for p in processes]
    finally:
        for process in processes:
            process.kill()
    assert all(len(words) == 2 for words, _ in outcomes), outcomes
    assert [(words[0], code) for words, code in outcomes] == [("0", 0)] * slices
    assert sum(int(words[1]) for words, _ in outcomes) == 65536


@pytest.mark.slow
def test_two_sum_roundings_the_kernel_skips_are_exact_for_every_bf16_pair(tmp_path):
    """All 2^32 input pairs (a few seconds): the proof behind the skipped roundings."""
    run_exhaustive_check("exhaustive_two_sum", tmp_path)


@pytest.mark.skipif(not X86, reason="the split tier is x86-64 only")
@pytest.mark.slow
def test_split_rounding_is_rb_or_flagged_for_every_fp32_value(tmp_path):
    """All 2^32 fp32 values (about 15 seconds): the proof behind the split tier."""
    run_exhaustive_check("exhaustive_split", tmp_path)
