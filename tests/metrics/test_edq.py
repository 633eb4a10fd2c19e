"""partials_close: when two EDQ partial-sum vectors count as equal."""

from __future__ import annotations

import torch

from collage_train.metrics.edq import edq_partials, partials_close


def sums(seed: int, n: int = 10_000, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    before = (torch.randn(n, generator=gen) * 0.05).bfloat16()
    update = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    after = (before.float() + update.float()).bfloat16()
    low = ((before.float() + update.float()) - after.float()).bfloat16()
    return edq_partials(before.to(dtype), after.to(dtype), update.to(dtype), low.to(dtype))


def test_the_same_sums_in_another_order_are_close():
    once = sums(0)
    # float64 accumulation differs from float32 by summation rounding only
    assert partials_close(sums(0, dtype=torch.float64).float(), once)
    assert partials_close(once, once.clone())


def test_a_cancelling_dot_product_is_judged_against_its_bound():
    base = sums(0)
    nudged = base.clone()
    nudged[5] += 1e-6 * (base[4] * base[1]).sqrt()  # far above 1e-5 of its own value
    assert partials_close(nudged, base)
    nudged[5] += 1e-3 * (base[4] * base[1]).sqrt()
    assert not partials_close(nudged, base)


def test_counts_must_match_exactly_and_nans_must_line_up():
    base = sums(0)
    for field in (2, 3):  # nonzero, lost
        other = base.clone()
        other[field] += 1
        assert not partials_close(other, base)
    other = base.clone()
    other[1] *= 1 + 1e-3
    assert not partials_close(other, base)
    with_nan = base.clone()
    with_nan[0] = float("nan")
    assert partials_close(with_nan, with_nan.clone())
    assert not partials_close(with_nan, base)


def test_layer_group_rows_sum_each_segment_into_its_group():
    """A whole tensor is one segment; a flat partition spans several layer groups."""
    from collage_train.metrics.edq import (
        FIELDS,
        edq_metrics,
        layer_group_metrics,
        layer_group_partials,
    )

    width = len(FIELDS)
    whole, flat = torch.zeros(4), torch.zeros(10)
    last = {
        whole: torch.arange(width, dtype=torch.float32),  # one row
        flat: torch.ones(2, width),  # two rows: block_0, then head
    }
    segments = {whole: [("block_0", 0, 4)], flat: [("block_0", 0, 6), ("head", 6, 10)]}
    sums = layer_group_partials(last, segments, ["block_0", "head"], torch.device("cpu"))
    assert torch.equal(sums[0], torch.arange(width, dtype=torch.float32) + 1)
    assert torch.equal(sums[1], torch.ones(width))
    metrics = layer_group_metrics(sums.flatten().tolist(), ["block_0", "head"], with_dtheta=True)
    whole_model = edq_metrics(sums.sum(0).tolist(), True)
    assert {k: metrics[k] for k in whole_model} == whole_model
    for group, row in (("block_0", sums[0]), ("head", sums[1])):
        for key, value in edq_metrics(row.tolist(), True).items():
            assert metrics[f"{key}.{group}"] == value
