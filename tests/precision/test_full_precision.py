"""Reading and writing each strategy's full-precision weights (what replicas exchange).

``full_precision_weights`` must return the most precise value a strategy holds (fp32
master, joined remainder, theta + dtheta, or the weight) and
``load_full_precision_weights`` must write a value back into the strategy's own
representation, exactly wherever that representation can hold it.
"""

from __future__ import annotations

import pytest
import torch
from strategy_steps import build, take_steps

from collage_train.optim import AdamW, CollageAdamW, SplitMasterAdamW
from collage_train.optim import remainder as remainder_bits

STRATEGIES = (
    "fp32",
    "mixed_fp32",
    "split_fp32",
    "bf16",
    "collage_light",
    "collage_plus",
    "scalify",  # bare fp16 parameters here: the scaled master kept beside them
    "scalify_fp32_params",
)


def snapshot(params, optimizer) -> list[torch.Tensor]:
    """Weights and every optimizer-state tensor, cloned."""
    tensors = [p.detach().clone() for p in params]
    for param in params:
        for value in optimizer.state[param].values():
            if torch.is_tensor(value):
                tensors.append(value.clone())
    return tensors


def assert_bitwise_equal(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def fp32_values(shapes, seed: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [0.05 * torch.randn(shape, generator=gen) for shape in shapes]


@pytest.mark.parametrize("name", STRATEGIES)
def test_values_are_new_fp32_tensors_in_param_group_order(name):
    params, optimizer = build(name)
    take_steps(params, optimizer)
    values = optimizer.full_precision_weights()
    assert [v.shape for v in values] == [p.shape for p in params]
    assert all(v.dtype == torch.float32 for v in values)
    assert all(v.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for v, p in zip(values, params, strict=True))  # fmt: skip
    values[0].add_(1.0)  # a copy: the optimizer's state is untouched
    assert not torch.equal(optimizer.full_precision_weights()[0], values[0])


def test_each_strategy_reports_its_most_precise_value():
    params, optimizer = build("mixed_fp32")
    take_steps(params, optimizer)
    assert isinstance(optimizer, AdamW)
    for param, value in zip(params, optimizer.full_precision_weights(), strict=True):
        assert torch.equal(value, optimizer.state[param]["master"])
        assert not torch.equal(value, param.float())  # the bf16 weight is only its rounding

    params, optimizer = build("split_fp32")
    take_steps(params, optimizer)
    assert isinstance(optimizer, SplitMasterAdamW)
    for param, value in zip(params, optimizer.full_precision_weights(), strict=True):
        state = optimizer.state[param]
        joined = remainder_bits.join(param.detach(), state["remainder"], state["remainder_ties"])
        assert torch.equal(value, joined)

    for name in ("collage_light", "collage_plus"):
        params, optimizer = build(name)
        take_steps(params, optimizer)
        assert isinstance(optimizer, CollageAdamW)
        for param, value in zip(params, optimizer.full_precision_weights(), strict=True):
            dtheta = optimizer.state[param]["dtheta"]
            assert bool(dtheta.ne(0).any())
            assert torch.equal(value, param.float() + dtheta.float())

    params, optimizer = build("scalify_fp32_params")  # the fp32 weight holds the fp16 master
    take_steps(params, optimizer)
    for param, value in zip(params, optimizer.full_precision_weights(), strict=True):
        assert torch.equal(value, param.float())
        data = value / optimizer.state[param]["master_scale"]
        assert torch.equal(data.half().float(), data)

    for name in ("fp32", "bf16"):
        params, optimizer = build(name)
        take_steps(params, optimizer)
        for param, value in zip(params, optimizer.full_precision_weights(), strict=True):
            assert torch.equal(value, param.float())


@pytest.mark.parametrize("name", ["fp32", "mixed_fp32", "split_fp32", "bf16"])
def test_state_round_trip_is_exact(name):
    """load(get()) leaves weight and every state tensor bit for bit as it was."""
    params, optimizer = build(name)
    take_steps(params, optimizer)
    before = snapshot(params, optimizer)
    optimizer.load_full_precision_weights(optimizer.full_precision_weights())
    assert_bitwise_equal(snapshot(params, optimizer), before)


@pytest.mark.parametrize("name", ["collage_light", "collage_plus"])
def test_collage_state_round_trip_is_exact_where_theta_plus_dtheta_fits_fp32(name):
    """(theta, dtheta) comes back unchanged whenever fl32(theta + dtheta) - theta == dtheta.

    An fp32 holds 24 significant bits; a dtheta far below theta's last bit does not fit
    beside it, and only there may the round trip differ (by less than one fp32 ulp).
    """
    params, optimizer = build(name)
    take_steps(params, optimizer, steps=20)
    thetas = [p.detach().clone() for p in params]
    dthetas = [optimizer.state[p]["dtheta"].clone() for p in params]
    values = optimizer.full_precision_weights()
    optimizer.load_full_precision_weights(values)
    for param, theta, dtheta, value in zip(params, thetas, dthetas, values, strict=True):
        fits = (value - theta.float()) == dtheta.float()
        assert fits.float().mean() > 0.9
        assert torch.equal(param.detach()[fits], theta[fits])
        assert torch.equal(optimizer.state[param]["dtheta"][fits], dtheta[fits])
        # Elsewhere the pair changes by less than an fp32 ulp of the value.
        new = param.float() + optimizer.state[param]["dtheta"].float()
        assert torch.equal(new, value)
    # The moments are never touched.
    for param in params:
        assert optimizer.state[param]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["fp32", "mixed_fp32", "split_fp32"])
def test_any_fp32_value_is_stored_exactly(name):
    """get(load(x)) == x for fp32-exact strategies, before and after the first step."""
    for steps in (0, 3):
        params, optimizer = build(name)
        take_steps(params, optimizer, steps=steps)
        values = fp32_values([p.shape for p in params])
        optimizer.load_full_precision_weights(values)
        assert_bitwise_equal(optimizer.full_precision_weights(), values)
        for param, value in zip(params, values, strict=True):
            assert torch.equal(param.detach(), value.to(param.dtype))  # the weight is its rounding


def test_split_master_keeps_exact_ties():
    """A value exactly halfway between two bf16 numbers keeps its remainder's far end."""
    params, optimizer = build("split_fp32")
    values = fp32_values([p.shape for p in params])
    tie = torch.tensor(1.0 + 2**-8, dtype=torch.float32)  # halfway between bf16 1 and 1+2^-7
    values[1][0] = tie
    optimizer.load_full_precision_weights(values)
    assert optimizer.full_precision_weights()[1][0] == tie
    assert optimizer.state[params[1]]["remainder_ties"].tolist() == [0]  # the +2^15 end


def test_bf16_weights_hold_their_rounding():
    params, optimizer = build("bf16")
    values = fp32_values([p.shape for p in params])
    optimizer.load_full_precision_weights(values)
    for param, value in zip(params, values, strict=True):
        assert torch.equal(param.detach(), value.bfloat16())
    rounded = [v.bfloat16().float() for v in values]
    optimizer.load_full_precision_weights(rounded)
    assert_bitwise_equal(optimizer.full_precision_weights(), rounded)


@pytest.mark.parametrize("name", ["collage_light", "collage_plus"])
def test_collage_splits_a_value_into_theta_and_dtheta(name):
    """theta = bf16(x), dtheta = bf16(x - theta); x with <= 16 significant bits survives."""
    for steps in (0, 3):
        params, optimizer = build(name)
        take_steps(params, optimizer, steps=steps)
        values = fp32_values([p.shape for p in params])
        optimizer.load_full_precision_weights(values)
        for param, value in zip(params, values, strict=True):
            theta = value.bfloat16()
            assert torch.equal(param.detach(), theta)
            dtheta = optimizer.state[param]["dtheta"]
            assert torch.equal(dtheta, (value - theta.float()).bfloat16())
            # Far closer than the bf16 weight alone: within 2^-16 relative.
            error = (param.float() + dtheta.float() - value).abs()
            assert bool((error <= value.abs() * 2**-16).all())
        # Values that theta + dtheta can hold come back exactly.
        representable = [p.float() + optimizer.state[p]["dtheta"].float() for p in params]
        optimizer.load_full_precision_weights(representable)
        assert_bitwise_equal(optimizer.full_precision_weights(), representable)


@pytest.mark.parametrize("name", STRATEGIES)
def test_training_continues_identically_after_a_round_trip(name):
    """A load of the current values does not disturb the following steps."""
    runs = []
    for round_trip in (False, True):
        params, optimizer = build(name)
        take_steps(params, optimizer, steps=3)
        if round_trip:
            optimizer.load_full_precision_weights(optimizer.full_precision_weights())
        take_steps(params, optimizer, steps=3, seed=7)
        runs.append(optimizer.full_precision_weights())
    plain, tripped = runs
    if name.startswith("collage"):  # exact except where theta + dtheta does not fit fp32
        for a, b in zip(plain, tripped, strict=True):
            assert (a != b).float().mean() < 0.05
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    else:
        assert_bitwise_equal(plain, tripped)


def test_wrong_count_or_shape_is_refused():
    _, optimizer = build("mixed_fp32")
    with pytest.raises(ValueError, match="expected 2 weight tensors"):
        optimizer.load_full_precision_weights([torch.zeros(1)])
    with pytest.raises(ValueError, match=r"shape \(48,\)"):
        optimizer.load_full_precision_weights([torch.zeros(64, 48), torch.zeros(47)])
