"""Multi-component floats (MCF): a value held as an unevaluated sum (x, dx) of two bf16s.

Every primitive uses bf16 operations only, each rounded once to nearest (fl()).
PyTorch evaluates a bf16 add or multiply in fp32 and rounds the result to bf16; for
two bf16 operands that equals the correctly rounded bf16 result (a sum whose exact
value needs more than fp32's 24 bits is dominated by one operand far beyond bf16's
half-ulp, and a product of two 8-bit significands is exact in fp32), so the classic
error-free transformations hold.

Each function takes either tensors or lists of tensors (the multi-tensor form runs on
``torch._foreach_*`` kernels), all bf16 and of matching shapes.
"""

from __future__ import annotations

import functools

import torch

Tensors = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]


def _many(a: Tensors) -> bool:
    return isinstance(a, list | tuple)


def _add(a: Tensors, b: Tensors) -> Tensors:
    return torch._foreach_add(a, b) if _many(a) else a + b


def _sub(a: Tensors, b: Tensors) -> Tensors:
    return torch._foreach_sub(a, b) if _many(a) else a - b


def _mul(a: Tensors, b: Tensors | float) -> Tensors:
    return torch._foreach_mul(a, b) if _many(a) else a * b


def fast_two_sum(a: Tensors, b: Tensors) -> tuple[Tensors, Tensors]:
    """Fast2Sum: s = fl(a + b) and t with s + t == a + b exactly, provided |a| >= |b|.

    Three operations. The precondition is on every element; when it fails the error
    term is only approximate (use ``two_sum``).
    """
    s = _add(a, b)
    t = _sub(b, _sub(s, a))
    return s, t


def two_sum(a: Tensors, b: Tensors) -> tuple[Tensors, Tensors]:
    """TwoSum (Knuth): s = fl(a + b) and t with s + t == a + b exactly, in any order.

    Six operations, no precondition on the magnitudes.
    """
    s = _add(a, b)
    a_approx = _sub(s, b)
    b_approx = _sub(s, a_approx)
    t = _add(_sub(a, a_approx), _sub(b, b_approx))
    return s, t


def two_prod(a: Tensors, b: Tensors | float) -> tuple[Tensors, Tensors]:
    """TwoProd: p = fl(a * b) and e with p + e == a * b exactly (barring underflow).

    ``b`` is a tensor (list) or a scalar holding a bf16 value. The product of two bf16
    values is exact in fp32, so e = fl(fp32(a) * fp32(b) - fp32(p)).
    """
    p = _mul(a, b)
    if _many(a):
        wide_b = b if isinstance(b, float | int) else [y.float() for y in b]
        exact = torch._foreach_mul([x.float() for x in a], wide_b)
        e = [(x - y.float()).to(y.dtype) for x, y in zip(exact, p, strict=True)]
    else:
        wide_b = b if isinstance(b, float | int) else b.float()
        e = (a.float() * wide_b - p.float()).to(p.dtype)
    return p, e


def grow(x: Tensors, dx: Tensors, a: Tensors) -> tuple[Tensors, Tensors]:
    """Add a bf16 value to an MCF: (x', dx') ~= (x + dx) + a, x' = fl(x' + dx').

    The first sum uses TwoSum rather than the paper's Fast2Sum: a weight near zero can
    be smaller than its update, which breaks Fast2Sum's |x| >= |a| precondition. The
    renormalisation uses Fast2Sum, whose precondition |s| >= |d| then holds.
    """
    s, e = two_sum(x, a)
    d = _add(dx, e)
    return fast_two_sum(s, d)


def mul(x: Tensors, dx: Tensors, b: float, db: float) -> tuple[Tensors, Tensors]:
    """Multiply an MCF by a constant MCF (b, db) whose parts are bf16 values.

    (p, e) = TwoProd(x, b); d = fl(fl(fl(dx * b) + fl(x * db)) + e); Fast2Sum(p, d).
    Never writes into its inputs (the authors' version aliased its output and counted
    the low part twice).
    """
    p, e = two_prod(x, b)
    d = _add(_add(_mul(dx, b), _mul(x, db)), e)
    return fast_two_sum(p, d)


@functools.cache
def split_constant(value: float, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """Split a float64 constant into (hi, lo) = (fl(value), fl(value - hi)) in ``dtype``.

    Computed in float64 whatever the global default dtype, so bf16(0.999) = 1.0 gets the
    remainder -0.001 (rounded to bf16) instead of 0.
    """
    hi = torch.tensor(value, dtype=torch.float64).to(dtype)
    lo = (torch.tensor(value, dtype=torch.float64) - hi.to(torch.float64)).to(dtype)
    return float(hi), float(lo)
