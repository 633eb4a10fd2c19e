"""MCF primitives: exactness checked in float64 on random bf16 inputs (hypothesis)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collage_train.optim.collage import mcf

BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def bf16_from_bits(bits: int) -> float:
    raw = np.array([bits], dtype=np.uint16).view(np.int16)
    return torch.from_numpy(raw).view(torch.bfloat16).item()


def bf16_values():
    """Every finite bf16 bit pattern: both signs, all exponents, zeros and subnormals."""
    return st.integers(min_value=0, max_value=0xFFFF).map(bf16_from_bits).filter(math.isfinite)


def as_bf16(values):
    return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16)


def exact(t):
    return t.double()


pairs = st.lists(st.tuples(bf16_values(), bf16_values()), min_size=1, max_size=64)


def _no_overflow(a, b):
    return (a.double().abs() + b.double().abs()).max() < BF16_MAX / 2


@settings(max_examples=300, deadline=None)
@given(pairs)
def test_two_sum_is_exact(values):
    a, b = as_bf16([x for x, _ in values]), as_bf16([y for _, y in values])
    if not _no_overflow(a, b):
        return
    s, t = mcf.two_sum(a, b)
    assert s.dtype == t.dtype == torch.bfloat16
    assert torch.equal(exact(s) + exact(t), exact(a) + exact(b))
    assert torch.equal(s, a + b)  # the high part is the rounded sum


@settings(max_examples=300, deadline=None)
@given(pairs)
def test_fast_two_sum_is_exact_when_ordered(values):
    a, b = as_bf16([x for x, _ in values]), as_bf16([y for _, y in values])
    if not _no_overflow(a, b):
        return
    big = torch.where(a.abs() >= b.abs(), a, b)
    small = torch.where(a.abs() >= b.abs(), b, a)
    s, t = mcf.fast_two_sum(big, small)
    assert torch.equal(exact(s) + exact(t), exact(big) + exact(small))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e15, 1e15), st.floats(-1e15, 1e15)), min_size=1, max_size=64))
def test_two_prod_is_exact_without_underflow(values):
    a, b = as_bf16([x for x, _ in values]), as_bf16([y for _, y in values])
    p, e = mcf.two_prod(a, b)
    product = exact(a) * exact(b)
    tiny = float(torch.finfo(torch.bfloat16).tiny) * 2**8  # error term stays normal
    normal = (product.abs() > tiny) | (product == 0)
    assert torch.equal((exact(p) + exact(e))[normal], product[normal])


@settings(max_examples=300, deadline=None)
@given(pairs, st.floats(0.5, 1.0))
def test_mul_of_two_pairs_is_within_a_few_units_of_2_pow_minus_16(values, beta):
    a, b = as_bf16([x for x, _ in values]), as_bf16([y for _, y in values])
    a, b = a.clamp(-1e30, 1e30), b.clamp(-1e30, 1e30)
    x, dx = mcf.two_sum(a, b)  # a normalised pair: |dx| <= half an ulp of x
    hi, lo = mcf.split_constant(beta)
    y, dy = mcf.mul(x, dx, hi, lo)
    truth = (exact(x) + exact(dx)) * beta
    error = (exact(y) + exact(dy) - truth).abs()
    # Relative to the product; below bf16's normal range only absolute accuracy remains.
    floor = float(torch.finfo(torch.bfloat16).tiny)
    assert torch.all(error <= 8 * 2.0**-16 * truth.abs() + floor)


def test_grow_accumulates_updates_that_bf16_loses():
    x = torch.ones(8, dtype=torch.bfloat16)
    dx = torch.zeros_like(x)
    update = torch.full_like(x, 1e-4)  # far below bf16's half-ulp at 1.0
    for _ in range(100):
        x, dx = mcf.grow(x, dx, update)
    total = exact(x) + exact(dx)
    intended = 1.0 + 100 * exact(update)
    # Each Grow rounds the low part once, by at most half its ulp (2^-16 of x here):
    # 100 steps stay within that bound, where plain bf16 loses all 0.01 of it.
    assert torch.all((total - intended).abs() <= 100 * 2.0**-16 * exact(x).abs())
    assert torch.all(x + update == x)  # a plain bf16 add would have lost every step


def test_grow_is_exact_when_the_update_is_larger_than_the_weight():
    x = as_bf16([1e-3, -2e-5, 0.0])
    dx = torch.zeros_like(x)
    a = as_bf16([0.75, 3.0, -1.5])
    y, dy = mcf.grow(x, dx, a)
    assert torch.equal(exact(y) + exact(dy), exact(x) + exact(a))


def test_multi_tensor_form_matches_single_tensors():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in (1, 7, 300)]
    dxs = [(torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) for n in (1, 7, 300)]
    us = [(torch.randn(n, generator=gen) * 1e-4).to(torch.bfloat16) for n in (1, 7, 300)]
    many = mcf.grow(xs, dxs, us)
    for i in range(3):
        one = mcf.grow(xs[i], dxs[i], us[i])
        assert torch.equal(many[0][i], one[0]) and torch.equal(many[1][i], one[1])
    many = mcf.mul(xs, dxs, 1.0, -0.0009765625)
    for i in range(3):
        one = mcf.mul(xs[i], dxs[i], 1.0, -0.0009765625)
        assert torch.equal(many[0][i], one[0]) and torch.equal(many[1][i], one[1])


@pytest.mark.parametrize("default", [torch.float32, torch.bfloat16, torch.float64])
def test_beta2_remainder_is_independent_of_the_default_dtype(default):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        hi, lo = mcf.split_constant(0.999)
    finally:
        torch.set_default_dtype(previous)
    assert hi == 1.0
    assert lo == float(torch.tensor(-0.001, dtype=torch.float64).to(torch.bfloat16))
    assert lo != 0.0
