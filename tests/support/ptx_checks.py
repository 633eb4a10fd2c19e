"""What PTX must not contain for the Collage kernels to stay bitwise equal to the eager step.

Correctly rounded division and square root, no flush-to-zero, no fp32 fused multiply-add,
round-to-nearest-even conversions to bf16; a bf16 FMA only as an add or a multiply
(tests/optim/test_triton_ptx.py explains why).
"""

from __future__ import annotations

import re

_FORBIDDEN = {
    "approximate division": re.compile(r"\bdiv\.(approx|full)\b"),
    "approximate square root": re.compile(r"\b(sqrt\.approx|rsqrt)\b"),
    "flush to zero": re.compile(r"\.ftz\b"),
    "fused multiply-add": re.compile(r"\bfma\.[a-z.]*f32\b"),
    "conversion to bf16 other than round-to-nearest-even": re.compile(r"\bcvt\.r[zmp]i?\.bf16"),
}


def violations(ptx: str) -> list[str]:
    found = [what for what, pattern in _FORBIDDEN.items() if pattern.search(ptx)]
    # registers holding bf16 +-1.0, alone or as a packed pair
    ones = set(re.findall(r"mov\.b16\s+(%rs\d+), 0x[3B]F80;", ptx))
    ones |= {m[1] for m in re.finditer(r"mov\.b32\s+(%r\d+), 0x([3B]F80)\2;", ptx)}
    zeros = set(re.findall(r"mov\.b16\s+(%rs\d+), 0x[08]000;", ptx))
    zeros |= {m[1] for m in re.finditer(r"mov\.b32\s+(%r\d+), 0x([08]000)\2;", ptx)}
    for kind, operands in re.findall(r"\bfma\.rn\.(bf16(?:x2)?)\s+([^;]*);", ptx):
        _, a, b, c = (o.strip() for o in operands.split(","))
        if not ({a, b} & ones or c in zeros):
            found.append(f"{kind} multiply-add that is neither an add nor a multiply")
    if re.search(r"\bfma\.(?!rn\.bf16)(?![a-z.]*f32\b)", ptx):
        found.append("fused multiply-add of another type")
    return found
