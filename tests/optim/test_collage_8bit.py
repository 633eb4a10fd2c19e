"""Collage8bitAdamW: Collage-light's (theta, dtheta) with 8-bit blockwise moments, v
stochastically rounded; float64 references and its optimizer contract."""

from __future__ import annotations

import pytest
import torch

from collage_train.metrics.edq import edq_metrics, partials_close
from collage_train.optim import CollageAdamW
from collage_train.optim.blockwise8 import dequantize, quantize
from collage_train.optim.blockwise_adamw import BlockwiseAdamW
from collage_train.optim.collage.eight_bit import Collage8bitAdamW


def _grads(numel: int, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(numel, generator=gen))
    return [(torch.randn(numel, generator=gen) * scale).bfloat16() for _ in range(steps)]


def _run(start, grads, chunk=None, track=False, **kwargs):
    param = torch.nn.Parameter(start.clone())
    opt = Collage8bitAdamW([param], lr=1e-3, weight_decay=0.1, **kwargs)
    if chunk is not None:
        opt.step_chunk_numel = chunk
    for grad in grads:
        param.grad = grad.clone()
        opt.track_edq = track
        opt.step()
    return param, opt


def _assert_same_state(opt_a, a, opt_b, b):
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert opt_a.state[a].keys() == opt_b.state[b].keys()
    for key, value in opt_a.state[a].items():
        other = opt_b.state[b][key]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def second_moment(opt, param) -> torch.Tensor:
    state = opt.state[param]
    return dequantize(state["exp_avg_sq"], state["exp_avg_sq_absmax"], signed=False).double()


# ------------------------------------------------------------------ float64 numerics


@pytest.mark.slow
def test_beta2_decay_survives_stochastic_rounding_and_sticks_under_nearest():
    """Elements whose gradient went to 0: v must decay as 0.999^t. In every block one
    element keeps gradient 1 (v = 1 = the block's absmax, held exactly). Under stochastic
    rounding (Collage8bitAdamW) the mean of v over 15,300 elements follows 0.999^t to
    within sampling error (z < 5); rounded to nearest (BlockwiseAdamW, bitsandbytes'
    rounding) every v stays where it started: the 11 % decay of 120 steps is lost."""
    blocks, steps, decay = 60, 120, 0.999
    gen = torch.Generator().manual_seed(0)
    start = torch.exp(torch.rand(blocks, 255, generator=gen) * -5.0)  # v/absmax in (e^-5, 1)
    # v_1 = (1 - beta2) g^2: about 1 for the held element, about `start` for the others
    first = (torch.cat([torch.ones(blocks, 1), start], 1).view(-1) * 1000).sqrt()
    later = torch.cat([torch.ones(blocks, 1), torch.zeros(blocks, 255)], 1).view(-1)
    decaying = later == 0
    results = {}
    for name, make, dtype in (
        ("stochastic", lambda p: Collage8bitAdamW(p, lr=0.0, seed=1), torch.bfloat16),
        ("nearest", lambda p: BlockwiseAdamW(p, lr=0.0), torch.float32),
    ):
        param = torch.nn.Parameter(torch.zeros(blocks * 256, dtype=dtype))
        opt = make([param])
        param.grad = first.to(dtype) if dtype == torch.float32 else first.bfloat16()
        opt.step()
        v_1 = second_moment(opt, param)[decaying]
        for _ in range(steps - 1):
            param.grad = later.to(dtype)
            opt.step()
        results[name] = (v_1, second_moment(opt, param)[decaying])
        held = second_moment(opt, param)[~decaying]
        assert float((held - 1).abs().max()) < 1e-3  # the blocks' absmax stays near 1
    v_1, v_t = results["stochastic"]
    expected = v_1 * decay ** (steps - 1)
    difference = v_t - expected
    z = float(difference.mean() / (difference.std() / difference.numel() ** 0.5))
    assert abs(z) < 5
    assert float(v_t.mean() / expected.mean()) == pytest.approx(1.0, abs=0.01)
    v_1, v_t = results["nearest"]
    assert torch.equal(v_t, v_1)  # stuck: no element decayed at all
    assert decay ** (steps - 1) < 0.89


def test_no_huge_step_when_a_tiny_gradient_stops():
    """An element whose gradients were 1e-4 of its block's largest, then exactly 0: its v
    (1e-8 of absmax) is kept at the map's smallest positive value, not 0, so the step
    stays under one lr (BlockwiseAdamW with bitsandbytes' rounding: thousands of lr)."""
    for relative in (3e-4, 1e-4, 1e-6):
        param = torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16))
        opt = Collage8bitAdamW([param], lr=1e-3)
        grad = torch.zeros(256)
        grad[0], grad[1] = 1.0, relative
        for _ in range(10):
            param.grad = grad.bfloat16()
            opt.step()
        assert float(second_moment(opt, param)[1]) > 0
        before = opt.full_precision_weights()[0][1]
        grad[1] = 0.0
        param.grad = grad.bfloat16()
        opt.step()
        assert abs(float(opt.full_precision_weights()[0][1] - before)) < 1e-3


def test_small_weight_updates_are_kept_in_dtheta():
    """lr = 1e-5 on weights in [0.5, 1.5] (bf16 ulp 2^-8 to 2^-7), constant gradients:
    plain bf16 (CollageAdamW "none") never moves; Collage8bit's theta + dtheta moves by
    50 * lr to within dtheta's own bf16 rounding (5 %), the very bits of Collage-light
    (with constant gradients every block holds one value: the 8-bit moments are exact)."""
    start = torch.linspace(0.5, 1.5, 1000).bfloat16()
    runs = {}
    for name in ("none", "light", "collage8"):
        param = torch.nn.Parameter(start.clone())
        if name == "collage8":
            opt = Collage8bitAdamW([param], lr=1e-5, betas=(0.9, 0.95))
        else:
            opt = CollageAdamW([param], lr=1e-5, betas=(0.9, 0.95), mode=name, kernel="eager")
        for _ in range(50):
            param.grad = torch.ones_like(param)
            opt.step()
        runs[name] = (param.detach(), opt.state[param].get("dtheta"))
    assert torch.equal(runs["none"][0], start)
    for light, eight_bit in zip(runs["light"], runs["collage8"], strict=True):
        assert torch.equal(light.view(torch.int16), eight_bit.view(torch.int16))
    theta, dtheta = runs["collage8"]
    moved = start.double() - (theta.double() + dtheta.double())
    assert float(moved.mean()) == pytest.approx(50 * 1e-5, rel=0.05)
    assert float(moved.min()) > 0 and torch.equal(theta, start)  # all of it in dtheta


def test_trajectory_follows_float64_adamw():
    """A noisy quadratic: Collage8bit's theta + dtheta stays within a few percent of the
    float64 AdamW path (1.9 % here; Collage-light's bf16 moments: 1.0 %)."""
    numel, steps, lr = 256 * 8, 100, 1e-2
    gen = torch.Generator().manual_seed(12)
    target = torch.randn(numel, generator=gen, dtype=torch.float64)
    noise = [torch.randn(numel, generator=gen, dtype=torch.float64) * 0.1 for _ in range(steps)]
    ref = torch.zeros(numel, dtype=torch.float64, requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    param = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16))
    opt = Collage8bitAdamW([param], lr=lr)
    for t in range(steps):
        ref.grad = ref.detach() - target + noise[t]
        ref_opt.step()
        value = opt.full_precision_weights()[0].double()
        param.grad = (value - target + noise[t]).bfloat16()
        opt.step()
    value = opt.full_precision_weights()[0].double()
    assert float((value - ref.detach()).norm() / ref.detach().norm()) < 0.05


# -------------------------------------------------------------- optimizer contract


def test_chunked_steps_equal_whole_steps_bitwise():
    """Whole blocks per chunk (a chunk size rounds down to whole blocks), a partial last
    block, EDQ tracked: weights, dtheta, codes and absmax are the same bits, stochastic
    rounding included (its bits come from each element's index)."""
    numel = 256 * 20 + 13
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1)).bfloat16()
    grads = _grads(numel, 4, seed=2)
    whole, whole_opt = _run(start, grads, track=True)
    for chunk in (256, 1000, 4099):
        chunked, chunked_opt = _run(start, grads, chunk=chunk, track=True)
        _assert_same_state(whole_opt, whole, chunked_opt, chunked)
        assert partials_close(whole_opt.last_edq[whole], chunked_opt.last_edq[chunked])


def test_state_dict_round_trip_continues_bitwise():
    numel = 256 * 6 + 40
    gen = torch.Generator().manual_seed(3)
    starts = [torch.randn(numel, generator=gen).bfloat16() for _ in range(2)]
    grads = [_grads(numel, 8, seed=4 + i) for i in range(2)]
    a = [torch.nn.Parameter(s.clone()) for s in starts]
    opt_a = Collage8bitAdamW(a, lr=1e-3, weight_decay=0.1, seed=5)
    for t in range(4):
        for p, g in zip(a, grads, strict=True):
            p.grad = g[t].clone()
        opt_a.step()
    saved = opt_a.state_dict()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = Collage8bitAdamW(b, lr=1e-3, weight_decay=0.1, seed=5)
    opt_b.load_state_dict(saved)
    assert [opt_b.state[p]["stream"] for p in b] == [0, 1]
    for t in range(4, 8):
        for pa, pb, g in zip(a, b, grads, strict=True):
            pa.grad, pb.grad = g[t].clone(), g[t].clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b, strict=True):
        _assert_same_state(opt_a, pa, opt_b, pb)


def test_streams_and_seed_choose_the_rounding_bits():
    """Two tensors with the same values and gradients get different streams, hence
    different stochastic roundings of v somewhere (m, rounded to nearest, is the same);
    the same seed repeats a run bit for bit, another seed rounds v differently."""
    numel = 256 * 8
    start = torch.randn(numel, generator=torch.Generator().manual_seed(6)).bfloat16()
    grads = _grads(numel, 3, seed=7)
    first, second = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = Collage8bitAdamW([first, second], lr=1e-3, seed=3)
    for grad in grads:
        first.grad, second.grad = grad.clone(), grad.clone()
        opt.step()
    state_1, state_2 = opt.state[first], opt.state[second]
    assert (state_1["stream"], state_2["stream"]) == (0, 1)
    assert not torch.equal(state_1["exp_avg_sq"], state_2["exp_avg_sq"])
    assert torch.equal(state_1["exp_avg"], state_2["exp_avg"])
    runs = [_run(start, grads, seed=seed) for seed in (3, 3, 4)]
    _assert_same_state(runs[0][1], runs[0][0], runs[1][1], runs[1][0])
    v_codes = [opt.state[param]["exp_avg_sq"] for param, opt in runs]
    assert not torch.equal(v_codes[0], v_codes[2])


def test_m_is_rounded_to_nearest_and_state_layout():
    numel = 256 * 3 + 5
    start = torch.randn(numel, generator=torch.Generator().manual_seed(8)).bfloat16()
    grad = _grads(numel, 1, seed=9)[0]
    param, opt = _run(start, [grad])
    state = opt.state[param]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].shape == param.shape
    assert state["exp_avg_absmax"].shape == (4,) and state["dtheta"].dtype == torch.bfloat16
    codes, absmax = quantize(0.1 * grad.float(), signed=True)
    assert torch.equal(state["exp_avg"], codes) and torch.equal(state["exp_avg_absmax"], absmax)


def test_full_precision_read_and_load():
    param = torch.nn.Parameter(torch.randn(300).bfloat16())
    opt = Collage8bitAdamW([param], lr=1e-3)
    assert torch.equal(opt.full_precision_weights()[0], param.detach().float())
    value = torch.randn(300, dtype=torch.float64).float()
    opt.load_full_precision_weights([value])
    theta, dtheta = param.detach(), opt.state[param]["dtheta"]
    assert torch.equal(theta, value.bfloat16())
    assert torch.equal(dtheta, (value - theta.float()).bfloat16())
    read = opt.full_precision_weights()[0]
    assert torch.equal(read, theta.float() + dtheta.float())
    assert float(((read - value) / value).abs().max()) < 2.0**-16  # two bf16 parts


def test_empty_and_flat_params_with_edq_segments():
    """An empty parameter steps; a flat partition gets one EDQ row per segment, summing to
    the whole tensor's partials; updates far above theta's ulp are realised (EDQ ~ 1)."""
    gen = torch.Generator().manual_seed(10)
    start = (torch.randn(256 * 4 + 100, generator=gen) * 0.01).bfloat16()
    flat, whole = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    empty = torch.nn.Parameter(torch.zeros(0, dtype=torch.bfloat16))
    opt = Collage8bitAdamW([flat, empty], lr=1e-2, weight_decay=0.1)
    reference = Collage8bitAdamW([whole], lr=1e-2, weight_decay=0.1)
    opt.edq_segments[flat] = [("a", 0, 300), ("b", 300, 900), ("c", 900, flat.numel())]
    opt.step_chunk_numel = 512
    for _ in range(2):
        grad = torch.randn(flat.shape, generator=gen).bfloat16()
        flat.grad, whole.grad, empty.grad = grad.clone(), grad.clone(), empty.detach().clone()
        opt.track_edq = reference.track_edq = True
        opt.step()
        reference.step()
    assert torch.equal(flat.view(torch.int16), whole.view(torch.int16))
    rows = opt.last_edq[flat]
    assert rows.shape == (3, 6)
    assert partials_close(rows.sum(dim=0), reference.last_edq[whole])
    metrics = edq_metrics(rows.sum(dim=0), with_dtheta=True)
    assert metrics["edq_normalized"] == pytest.approx(1.0, abs=0.01)
    assert metrics["dtheta_norm"] > 0
    assert opt.state[empty]["step"] == 2 and opt.state[empty]["exp_avg_sq_absmax"].numel() == 0
    assert float(opt.last_edq[empty].abs().sum()) == 0.0


def test_a_transposed_parameter_steps_as_its_contiguous_copy():
    """Blocks run over the flattened (row-major) order, whatever the strides."""
    gen = torch.Generator().manual_seed(13)
    base = torch.randn(40, 30, generator=gen).bfloat16()
    strided = torch.nn.Parameter(base.t())  # 30 x 40, not contiguous
    dense = torch.nn.Parameter(base.t().contiguous())
    assert not strided.is_contiguous()
    opts = [Collage8bitAdamW([p], lr=1e-3, weight_decay=0.1) for p in (strided, dense)]
    for grad in _grads(30 * 40, 3, seed=14):
        strided.grad, dense.grad = grad.view(30, 40).clone(), grad.view(30, 40).clone()
        for opt in opts:
            opt.step()
    _assert_same_state(opts[0], strided, opts[1], dense)


def test_non_bf16_params_and_bad_block_size_are_refused():
    with pytest.raises(TypeError, match="bf16 parameters"):
        Collage8bitAdamW([torch.nn.Parameter(torch.ones(4))])
    with pytest.raises(ValueError, match="block_size"):
        Collage8bitAdamW([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], block_size=0)
