"""Power-of-two scales: exactness, rounding down, and the propagation rules."""

from __future__ import annotations

import math

import pytest
import torch

from collage_train.scalify.scale import (
    ExactFp16Scales,
    add_scale,
    is_power_of_two,
    matmul_scale,
    mul_scale,
    pow2_floor,
    rms_scale,
    sum_scale,
)


def _mantissas_are_half(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa == 0.5).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pow2_floor_is_an_exact_power_of_two_rounded_down(dtype):
    torch.manual_seed(0)
    tiny = torch.finfo(dtype).tiny
    x = torch.cat(
        [
            torch.randn(1000, dtype=dtype) * 10.0 ** torch.randint(-30, 30, (1000,)).to(dtype),
            torch.tensor([tiny, tiny / 3, torch.finfo(dtype).max, 1.0, -1.0, 0.75], dtype=dtype),
        ]
    )
    x = x[x != 0]
    floor = pow2_floor(x)
    assert floor.dtype == dtype
    assert _mantissas_are_half(floor)
    assert bool((floor <= x.abs()).all())
    assert bool((floor * 2 > x.abs()).all())


def test_pow2_floor_special_values():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, 3.0, -5.0])
    floor = pow2_floor(x)
    assert floor[:2].tolist() == [0.0, 0.0]
    assert floor[2:4].tolist() == [math.inf, math.inf]
    assert math.isnan(floor[4].item())
    assert floor[5:].tolist() == [1.0, 2.0, 4.0]


def test_is_power_of_two():
    assert is_power_of_two(torch.tensor([1.0, 0.5, 2.0**-140, 2.0**127]))
    for bad in (3.0, 0.0, -1.0, math.inf, math.nan):
        assert not is_power_of_two(torch.tensor([1.0, bad]))


def test_rms_scale_rounds_the_rms_down():
    torch.manual_seed(1)
    for magnitude in (1e-30, 1e-6, 1.0, 1e4, 1e30):
        t = torch.randn(37, 5) * magnitude
        rms = t.double().square().mean().sqrt().item()
        scale = rms_scale(t)
        assert scale.dtype == torch.float32 and scale.dim() == 0
        assert is_power_of_two(scale)
        assert scale.item() <= rms < 2 * scale.item()


def test_rms_scale_does_not_overflow_the_squares():
    t = torch.full((4,), 3e38)
    assert rms_scale(t).item() == 2.0**128 / 2


def test_rms_scale_of_zeros_is_one_and_of_nonfinite_is_nonfinite():
    assert rms_scale(torch.zeros(3, 3)).item() == 1.0
    assert rms_scale(torch.zeros(0)).item() == 1.0
    assert not torch.isfinite(rms_scale(torch.tensor([1.0, math.inf])))
    assert not torch.isfinite(rms_scale(torch.tensor([1.0, math.nan])))


def _pow2(e: int) -> torch.Tensor:
    return torch.tensor(2.0**e)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 15, 16, 17, 768, 1000, 1024, 3072, 50257])
def test_matmul_scale_matches_the_formula(k):
    for ea, eb in ((0, 0), (-7, 3), (20, -40)):
        scale = matmul_scale(_pow2(ea), _pow2(eb), k)
        expected = 2.0**ea * 2.0**eb * 2.0 ** math.floor(math.log2(math.sqrt(k)))
        assert is_power_of_two(scale)
        assert scale.item() == expected
        assert scale.item() / (2.0**ea * 2.0**eb) <= math.sqrt(k)


def test_sum_scale_matches_the_formula():
    assert sum_scale(_pow2(-3), 1000).item() == 2.0**-3 * 16
    assert sum_scale(_pow2(5), 1).item() == 2.0**5


def test_add_scale_matches_the_formula_and_rounds_down():
    for ea, eb in ((0, 0), (3, 1), (-10, 4), (60, 60), (-100, -99)):
        scale = add_scale(_pow2(ea), _pow2(eb))
        exact = math.sqrt(4.0**ea + 4.0**eb)
        assert is_power_of_two(scale)
        assert scale.item() <= exact < 2 * scale.item()
        assert scale.item() == max(2.0**ea, 2.0**eb)
    non_pow2 = add_scale(torch.tensor(3.0), torch.tensor(4.0))
    assert non_pow2.item() == 4.0


def test_mul_scale_matches_the_formula():
    scale = mul_scale(_pow2(-20), _pow2(7))
    assert is_power_of_two(scale)
    assert scale.item() == 2.0**-13
    assert mul_scale(torch.tensor(3.0), torch.tensor(3.0)).item() == 8.0


def test_rules_keep_the_device_and_float32():
    for scale in (
        matmul_scale(_pow2(1), _pow2(2), 64),
        add_scale(_pow2(1), _pow2(2)),
        mul_scale(_pow2(1), _pow2(2)),
    ):
        assert scale.dtype == torch.float32 and scale.dim() == 0


def _fp16_holds(values: torch.Tensor, ks: torch.Tensor) -> list[bool]:
    """float64 reference, for each exponent k of ``ks``: ``values / 2**k`` stored as fp16
    (clamped to its range, as ``store_scaled`` clamps) reads back unchanged. Any rounding
    of a value fp16 holds is the value, and of one it does not hold is another value."""
    data = values.double()[None, :] / torch.pow(2.0, ks.double())[:, None]
    stored = data.clamp(-65504, 65504).to(torch.float16).double()
    return (stored == data).all(dim=1).tolist()  # nan: never equal


def _exactness_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([65504.0, 65505.0, 65519.0, 65520.0, 2.0**-24, 3 * 2.0**-24, 2.0**-25,
                          0.0, -0.0, 2047.0, 2049.0, 4094.0, 4095.0])  # fmt: skip
    cases = [torch.zeros(3), torch.tensor([math.nan, 1.0]), torch.tensor([math.inf, 1.0])]
    for n in range(120):
        shift = 2.0 ** int(torch.randint(-40, 40, (1,), generator=gen))
        sample = torch.randn(1 + n % 7, generator=gen)
        cases.append(
            [
                (sample * 100).half().double() * shift,  # fp16 values, scaled
                sample.bfloat16().double() * shift,  # 8 significant bits
                sample.float().double(),  # 24: fp16 holds none under any scale
                torch.randint(-9000, 9000, sample.shape, generator=gen).double() * shift,
                edges[torch.randint(0, len(edges), sample.shape, generator=gen)] * shift,
            ][n % 5]
        )
    return cases


def test_exact_fp16_scales_are_the_powers_of_two_under_which_fp16_holds_every_element():
    """Fed in one piece or in two, the interval of exponents agrees with the float64
    reference for every power of two from 2**-80 to 2**79 (nan and inf: none)."""
    ks = torch.arange(-80, 80)
    for values in _exactness_cases():
        expected = _fp16_holds(values, ks)
        for pieces in (1, 2):
            exact = ExactFp16Scales()
            for piece in values.chunk(pieces):
                exact.add(piece)
            held = [exact.holds(torch.tensor(2.0 ** int(k), dtype=torch.float64)) for k in ks]
            assert held == expected, values
    assert not ExactFp16Scales().holds(torch.tensor(3.0))  # not a power of two
