"""8-bit blockwise quantisation (optim.blockwise8) and BlockwiseAdamW, against bitsandbytes
0.50.2 on CPU and float64 references."""

from __future__ import annotations

import pytest
import torch

from collage_train.metrics.edq import partials_close
from collage_train.optim import AdamW, rounding_noise
from collage_train.optim.blockwise8 import dequantize, dynamic_map, num_blocks, quantize
from collage_train.optim.blockwise_adamw import BlockwiseAdamW

# The reference library (a dev extra); a machine without it, such as a bare GPU box, skips.
bitsandbytes = pytest.importorskip("bitsandbytes")
import bitsandbytes.backends.cpu.ops as bnb_cpu_ops  # noqa: E402
import bitsandbytes.functional as bnb_functional  # noqa: E402

UNIT = 2.0**-24  # fp32 unit roundoff
_QUANTIZE = torch.ops.bitsandbytes.quantize_blockwise.default
_DEFAULT_BACKEND = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def bnb_default_quantize(values: torch.Tensor, code: torch.Tensor, block: int):
    """bitsandbytes' default-backend quantize_blockwise (its CPU kernel is a table lookup)."""
    return _QUANTIZE.redispatch(_DEFAULT_BACKEND, values, code, block)


def wide_values(numel: int, seed: int) -> torch.Tensor:
    """Signed values spanning many decades, with a block of zeros (elements 256-511)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 3)
    values[256:512] = 0.0
    return values


# ------------------------------------------------------------ against bitsandbytes


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_bitsandbytes_dynamic_maps(signed):
    ours = dynamic_map(signed)
    assert torch.equal(ours, bnb_functional.create_dynamic_map(signed=signed))
    assert ours.numel() == 256 and bool((ours[1:] > ours[:-1]).all())
    assert ours[-1] == 1.0 and (0.0 in ours.tolist())
    if signed:  # 127 negatives mirroring the 127 positives below 1; no -1
        assert torch.equal(ours[:127], -ours[128:255].flip(0))
        assert -1.0 < float(ours[0]) < -0.99
    else:
        assert ours[0] == 0.0


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [256 * 12, 256 * 12 + 77, 77])
def test_round_to_nearest_is_bitsandbytes_default_backend_bitwise(signed, numel):
    values = wide_values(numel, seed=numel)
    values = values if signed else values.square()
    code = bnb_functional.create_dynamic_map(signed=signed)
    codes, absmax = quantize(values, signed)
    bnb_codes, bnb_absmax = bnb_default_quantize(values, code, 256)
    assert torch.equal(codes, bnb_codes) and torch.equal(absmax, bnb_absmax)
    assert absmax.numel() == num_blocks(numel)
    # dequantisation: bitsandbytes' CPU kernel (C) and its functional API, bit for bit
    ours = dequantize(codes, absmax, signed)
    assert torch.equal(
        ours, torch.ops.bitsandbytes.dequantize_blockwise(codes, absmax, code, 256, torch.float32)
    )
    state = bnb_functional.QuantState(absmax=absmax, code=code, blocksize=256, dtype=torch.float32)
    assert torch.equal(ours, bnb_functional.dequantize_blockwise(codes, state))
    if numel > 512:
        assert bool((ours[256:512] == 0).all())  # the zero block


@pytest.mark.parametrize("signed", [True, False])
def test_bitsandbytes_cpu_kernel_is_a_coarser_table_lookup(signed):
    """bitsandbytes' CPU kernel looks x up in 65536 even bins of [-1, 1]: never nearer
    than our round to nearest, at most 2/65535 farther (docs: the bin's half-width twice)."""
    values = wide_values(256 * 40, seed=1)
    values = values if signed else values.square()
    code = bnb_functional.create_dynamic_map(signed=signed)
    codes, absmax = quantize(values, signed)
    lut_codes, lut_absmax = _QUANTIZE(values, code, 256)
    assert torch.equal(absmax, lut_absmax)
    scale = absmax.repeat_interleave(256).double()
    ours = (dequantize(codes, absmax, signed).double() - values.double()).abs()
    lut = (dequantize(lut_codes, absmax, signed).double() - values.double()).abs()
    slack = scale * 4 * UNIT  # the fp32 roundings of scaling and dequantising
    assert bool((ours <= lut + slack).all())
    assert bool((lut <= ours + scale * 2 / 65535 + slack).all())
    assert int((codes != lut_codes).sum()) > 0  # they do differ: the comparison has teeth


# --------------------------------------------------------- float64 error bounds


def interval_values(signed: bool, fractions: list[float], absmax: float) -> tuple:
    """fp32 values at each fraction of every interval [c_k, c_{k+1}] of the map, in blocks
    whose first element is ``absmax`` (so the block's absmax is exactly ``absmax``)."""
    code = dynamic_map(signed).double()
    low, gap = code[:-1], code[1:] - code[:-1]
    x = torch.cat([low + f * gap for f in fractions])
    k = torch.arange(255).repeat(len(fractions))
    per_block = 255
    pad = (-x.numel()) % per_block
    x = torch.cat([x, torch.zeros(pad, dtype=torch.float64)])
    k = torch.cat([k, torch.full((pad,), -1)])
    blocks = x.numel() // per_block
    values = torch.cat([torch.ones(blocks, 1, dtype=torch.float64), x.view(blocks, -1)], 1)
    index = torch.cat([torch.full((blocks, 1), -1), k.view(blocks, -1)], 1).view(-1)
    fp32 = (values * absmax).float().view(-1)
    return fp32, index


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("absmax", [1.0, 3.7e-3, 2.5e5])
def test_dequantization_error_is_within_half_a_gap(signed, absmax):
    """|deq(q(v)) - v| <= absmax * (g_k / 2 + 2^-22) for v / absmax in [c_k, c_{k+1}] of
    gap g_k (round to nearest), <= absmax * (g_k + 2^-22) and one of the two ends
    (stochastic); the bound is attained (the test would see a coarser rounding)."""
    fractions = [0.0, 0.1, 0.25, 0.4999, 0.5, 0.5001, 0.75, 0.9, 1.0]
    values, k = interval_values(signed, fractions, absmax)
    code = dynamic_map(signed).double()
    inside = k >= 0
    gap = (code[1:] - code[:-1])[k.clamp(min=0)]
    slack = absmax * 4 * UNIT
    noise = rounding_noise.uniform(
        rounding_noise.random_bits(values.numel(), seed=3, stream=0, step=1)
    )
    for rounding, bound in ((None, 0.5), (noise, 1.0)):
        codes, scales = quantize(values, signed, noise=rounding)
        assert torch.equal(scales, torch.full_like(scales, float(torch.tensor(absmax).float())))
        error = (dequantize(codes, scales, signed).double() - values.double()).abs()[inside]
        assert bool((error <= absmax * bound * gap[inside] + slack).all())
        if rounding is None:
            assert float((error / (absmax * 0.5 * gap[inside] + slack)).max()) > 0.99
        else:  # one of the two ends of the interval
            ends = torch.stack([k, k + 1])[:, inside]
            assert bool((codes.view(-1)[inside].long() == ends).any(dim=0).all())


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    """x at a fraction f of the way between neighbouring values: stochastic rounding goes
    up with probability f (binomial test over every interval and 64 draws); rounding to
    nearest goes up never for f < 1/2, always above: a bias of -f or 1 - f of the gap."""
    fractions = [0.05, 0.3, 0.7, 0.95]
    values, k = interval_values(False, fractions, 1.0)
    code = dynamic_map(False).double()
    inside = k >= 0
    x = values.double()[inside]
    low, high = code[k[inside]], code[k[inside] + 1]
    f = (x - low) / (high - low)  # of the fp32 values actually stored
    draws = 64
    ups = torch.zeros(inside.sum(), dtype=torch.float64)
    for step in range(1, draws + 1):
        bits = rounding_noise.random_bits(values.numel(), seed=7, stream=1, step=step)
        codes, _ = quantize(values, False, noise=rounding_noise.uniform(bits))
        ups += (codes.view(-1)[inside].long() == k[inside] + 1).double()
    for fraction in fractions:
        group = (f - fraction).abs() < 1e-3
        trials = draws * int(group.sum())
        observed = float(ups[group].sum()) / trials
        expected = float(f[group].mean())
        sigma = (expected * (1 - expected) / trials) ** 0.5
        assert abs(observed - expected) < 5 * sigma
    nearest, _ = quantize(values, False)
    up_nearest = (nearest.view(-1)[inside].long() == k[inside] + 1).double()
    assert torch.equal(up_nearest, (f > 0.5).double())


def test_every_code_is_a_fixed_point_of_beta2_decay_under_nearest():
    """v <- RTN(0.999 v) never moves: every gap of the unsigned map exceeds 0.2 % of the
    value above it (the smallest, 0.35 %, is at the top), so v's decay is rounded away."""
    code = dynamic_map(False)
    values = torch.cat([torch.ones(1), code[1:]]).repeat(4)  # absmax 1 in each block
    codes, absmax = quantize(values, False)
    decayed = dequantize(codes, absmax, False) * 0.999
    decayed[::256] = 1.0  # the element holding the block's absmax keeps its gradient
    assert torch.equal(quantize(decayed, False)[0], codes)
    relative_gap = (code[2:] - code[1:-1]) / code[2:]
    assert float(relative_gap.min()) > 2 * 0.001


def test_keep_nonzero_floors_positive_second_moments_only():
    """keep_nonzero: a positive value that rounds to 0 (below 1.6e-7 of absmax) or would
    be rounded down to 0 takes the smallest positive value; zeros and all else as before."""
    values = torch.tensor([1.0, 1e-9, 1e-7, 2e-7, 0.0, 0.5] * 64)
    noise = torch.full((values.numel(),), 0.999)  # stochastic rounding: always down
    for rounding in (None, noise):
        plain, absmax = quantize(values, False, noise=rounding)
        floored, same_absmax = quantize(values, False, noise=rounding, keep_nonzero=True)
        assert torch.equal(absmax, same_absmax)
        positive = values > 0
        assert bool((floored[positive] > 0).all()) and bool((floored[~positive] == 0).all())
        changed = floored != plain
        assert bool((plain[changed] == 0).all()) and bool((floored[changed] == 1).all())
        assert int(changed.sum()) > 0
    with pytest.raises(ValueError, match="unsigned"):
        quantize(values, True, keep_nonzero=True)


def zero_gradient_step(make, dtype, relative: float) -> float:
    """|step| / lr of an element whose gradients were ``relative`` of its block's largest
    for 10 steps, at a step where its gradient is exactly 0 (lr 1e-3)."""
    param = torch.nn.Parameter(torch.zeros(256, dtype=dtype))
    opt = make([param])
    grad = torch.zeros(256)
    grad[0], grad[1] = 1.0, relative
    for _ in range(10):
        param.grad = grad.to(dtype)
        opt.step()
    before = opt.full_precision_weights()[0][1]
    grad[1] = 0.0
    param.grad = grad.to(dtype)
    opt.step()
    return abs(float(opt.full_precision_weights()[0][1] - before)) / 1e-3


def test_a_second_moment_rounded_to_zero_makes_a_huge_step():
    """bitsandbytes' rounding (BlockwiseAdamW's default): gradients 1e-4 of the block's
    largest give v / absmax = 1e-8, stored as 0, while m is not 0; a zero gradient then
    steps m / eps: thousands of lr where AdamW steps under one lr. keep_nonzero_v keeps
    the step under one lr."""
    adamw = zero_gradient_step(lambda p: AdamW(p, lr=1e-3), torch.float32, 1e-4)
    assert 0.5 < adamw < 1.0
    exact = zero_gradient_step(lambda p: BlockwiseAdamW(p, lr=1e-3), torch.float32, 1e-4)
    assert exact > 1000
    for relative in (3e-4, 1e-4, 1e-6):
        floored = zero_gradient_step(
            lambda p: BlockwiseAdamW(p, lr=1e-3, keep_nonzero_v=True), torch.float32, relative
        )
        assert floored < 1.0


# ------------------------------------------------------ BlockwiseAdamW vs bitsandbytes


def _exact_requantize(values, code, absmax_out, codes_out, block):
    codes, absmax = bnb_default_quantize(values, code, block)
    codes_out.copy_(codes)
    absmax_out.copy_(absmax)


@pytest.fixture
def bnb_nearest(monkeypatch):
    """bitsandbytes' CPU AdamW8bit with its default backend's round to nearest in place of
    the CPU kernel's table lookup (the one difference between the two)."""
    monkeypatch.setattr(bnb_cpu_ops, "_quant_blockwise_fp32_direct", _exact_requantize)


def _grads(numel: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(numel, generator=gen))  # elements of different sizes
    return [torch.randn(numel, generator=gen) * scale * (1 + t) for t in range(steps)]


def _assert_same_as_bnb(ours_opt, ours, bnb_opt, theirs):
    ours_state, bnb_state = ours_opt.state[ours], bnb_opt.state[theirs]
    assert torch.equal(ours_state["exp_avg"], bnb_state["state1"])
    assert torch.equal(ours_state["exp_avg_sq"], bnb_state["state2"])
    assert torch.equal(ours_state["exp_avg_absmax"], bnb_state["absmax1"])
    assert torch.equal(ours_state["exp_avg_sq_absmax"], bnb_state["absmax2"])


def test_blockwise_adamw_is_bitsandbytes_adamw8bit_bitwise(bnb_nearest):
    """fp32 parameters, weight decay, a partial last block, steps in chunks: after each of
    8 steps the parameters, codes and absmax equal bitsandbytes' bit for bit."""
    numel = 256 * 30 + 77
    start = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    bnb_opt = bitsandbytes.optim.AdamW8bit([theirs], lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    opt = BlockwiseAdamW([ours], lr=1e-2, weight_decay=0.1)
    opt.step_chunk_numel = 1000  # 768: three whole blocks per chunk
    for grad in _grads(numel, 8):
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        bnb_opt.step()
        opt.step()
        assert torch.equal(ours, theirs)
        _assert_same_as_bnb(opt, ours, bnb_opt, theirs)


def test_fp32_master_follows_bitsandbytes_on_fp32_copies(bnb_nearest):
    """bf16 parameters with an fp32 master (adamw_8bit): the master is bitsandbytes' fp32
    parameter given the same (bf16) gradients, and the weight its bf16 rounding."""
    numel = 256 * 8
    start = torch.randn(numel, generator=torch.Generator().manual_seed(6)).bfloat16()
    theirs = torch.nn.Parameter(start.float())
    ours = torch.nn.Parameter(start.clone())
    bnb_opt = bitsandbytes.optim.AdamW8bit([theirs], lr=3e-3, weight_decay=0.1, min_8bit_size=0)
    opt = BlockwiseAdamW([ours], lr=3e-3, weight_decay=0.1, master_dtype=torch.float32)
    for grad in _grads(numel, 5, seed=2):
        grad = grad.bfloat16()
        theirs.grad, ours.grad = grad.float(), grad.clone()
        bnb_opt.step()
        opt.step()
    assert torch.equal(opt.state[ours]["master"], theirs.detach())
    assert torch.equal(ours.detach(), theirs.detach().bfloat16())
    _assert_same_as_bnb(opt, ours, bnb_opt, theirs)


def test_stock_bitsandbytes_differs_only_by_its_table_lookup():
    """Stock bitsandbytes (CPU table lookup): the first step's parameters are the same bits
    (both update with the moments before quantisation); its stored moments sit at most
    2/65535 of a block's absmax farther from the exact ones than ours."""
    numel = 256 * 16
    start = torch.randn(numel, generator=torch.Generator().manual_seed(8))
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    bnb_opt = bitsandbytes.optim.AdamW8bit([theirs], lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    opt = BlockwiseAdamW([ours], lr=1e-2, weight_decay=0.1)
    grad = _grads(numel, 1)[0]
    theirs.grad, ours.grad = grad.clone(), grad.clone()
    bnb_opt.step()
    opt.step()
    assert torch.equal(ours, theirs)
    exact = {"exp_avg": 0.1 * grad.double(), "exp_avg_sq": 0.001 * grad.double().square()}
    for name, signed, key in (("exp_avg", True, "1"), ("exp_avg_sq", False, "2")):
        state, bnb_state = opt.state[ours], bnb_opt.state[theirs]
        absmax = state[f"{name}_absmax"].repeat_interleave(256).double()
        ours_err = (
            dequantize(state[name], state[f"{name}_absmax"], signed).double() - exact[name]
        ).abs()
        bnb_values = dequantize(
            bnb_state[f"state{key}"], bnb_state[f"absmax{key}"], signed
        ).double()
        bnb_err = (bnb_values - exact[name]).abs()
        assert bool((bnb_err <= ours_err + absmax * (2 / 65535 + 8 * UNIT)).all())


# -------------------------------------------------------- BlockwiseAdamW's own contract


def _run(opt_factory, start, grads, chunk=None, track=False):
    param = torch.nn.Parameter(start.clone())
    opt = opt_factory([param])
    if chunk is not None:
        opt.step_chunk_numel = chunk
    for grad in grads:
        param.grad = grad.to(param.dtype)
        opt.track_edq = track
        opt.step()
    return param, opt


def _assert_same_state(opt_a, a, opt_b, b):
    assert torch.equal(a, b)
    for key, value in opt_a.state[a].items():
        other = opt_b.state[b][key]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def test_chunked_steps_equal_whole_steps_bitwise():
    numel = 256 * 20 + 13
    start = torch.randn(numel, generator=torch.Generator().manual_seed(9)).bfloat16()
    grads = _grads(numel, 4, seed=3)

    def factory(params):
        return BlockwiseAdamW(params, lr=1e-3, weight_decay=0.1, master_dtype=torch.float32)

    whole, whole_opt = _run(factory, start, grads, track=True)
    for chunk in (256, 1000, 4099):
        chunked, chunked_opt = _run(factory, start, grads, chunk=chunk, track=True)
        _assert_same_state(whole_opt, whole, chunked_opt, chunked)
        assert partials_close(whole_opt.last_edq[whole], chunked_opt.last_edq[chunked])


def test_state_dict_round_trip_continues_bitwise():
    numel = 256 * 6 + 40
    start = torch.randn(numel, generator=torch.Generator().manual_seed(10)).bfloat16()
    grads = _grads(numel, 8, seed=4)

    def factory(params):
        return BlockwiseAdamW(params, lr=1e-3, weight_decay=0.1, master_dtype=torch.float32)

    a, opt_a = _run(factory, start, grads[:4])
    saved = opt_a.state_dict()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = factory([b])
    opt_b.load_state_dict(saved)
    for grad in grads[4:]:
        a.grad, b.grad = grad.bfloat16(), grad.bfloat16()
        opt_a.step()
        opt_b.step()
    _assert_same_state(opt_a, a, opt_b, b)
    assert opt_b.state[b]["exp_avg"].dtype == torch.uint8


def test_full_precision_is_the_master():
    param = torch.nn.Parameter(torch.randn(300).bfloat16())
    opt = BlockwiseAdamW([param], lr=1e-3, master_dtype=torch.float32)
    value = torch.randn(300)
    opt.load_full_precision_weights([value])
    assert torch.equal(opt.full_precision_weights()[0], value)
    assert torch.equal(param.detach(), value.bfloat16())
    param.grad = torch.randn(300).bfloat16()
    opt.step()
    assert torch.equal(opt.full_precision_weights()[0], opt.state[param]["master"])


def test_empty_and_flat_params_with_edq_segments():
    """An empty parameter steps (zero partials); a flat partition gets one EDQ row per
    segment, summing to the whole tensor's partials; the update matches AdamW's EDQ."""
    gen = torch.Generator().manual_seed(11)
    flat = torch.nn.Parameter(torch.randn(256 * 4 + 100, generator=gen))
    empty = torch.nn.Parameter(torch.zeros(0))
    opt = BlockwiseAdamW([flat, empty], lr=1e-3, weight_decay=0.1)
    opt.edq_segments[flat] = [("a", 0, 300), ("b", 300, 900), ("c", 900, flat.numel())]
    opt.edq_view_dtype = torch.bfloat16
    opt.step_chunk_numel = 512
    whole = torch.nn.Parameter(flat.detach().clone())
    reference = BlockwiseAdamW([whole], lr=1e-3, weight_decay=0.1)
    reference.edq_view_dtype = torch.bfloat16
    for _ in range(2):
        grad = torch.randn(flat.shape, generator=gen)
        flat.grad, whole.grad, empty.grad = grad.clone(), grad.clone(), torch.zeros(0)
        opt.track_edq = reference.track_edq = True
        opt.step()
        reference.step()
    rows = opt.last_edq[flat]
    assert rows.shape == (3, 6)
    assert partials_close(rows.sum(dim=0), reference.last_edq[whole])
    assert torch.equal(flat, whole)
    assert float(opt.last_edq[empty].abs().sum()) == 0.0
    assert opt.state[empty]["step"] == 2 and opt.state[empty]["exp_avg_absmax"].numel() == 0
    # an fp32 update is realised in full: normalised EDQ 1 (in fp32 view)
    fp32 = torch.nn.Parameter(torch.randn(4096, generator=gen))
    fp32_opt = BlockwiseAdamW([fp32], lr=1e-3)
    fp32.grad = torch.randn(4096, generator=gen)
    fp32_opt.track_edq = True
    fp32_opt.step()
    assert fp32_opt.edq_metrics()["edq_normalized"] == pytest.approx(1.0, abs=1e-4)


def test_updates_track_float64_adamw():
    """Trajectory of a quadratic's minimisation: the 8-bit moments stay within a few
    percent of float64 AdamW's path, as torch's fp32 AdamW does within a fraction of one."""
    numel, steps, lr = 256 * 8, 200, 1e-2
    gen = torch.Generator().manual_seed(12)
    target = torch.randn(numel, generator=gen, dtype=torch.float64)
    noise = [torch.randn(numel, generator=gen, dtype=torch.float64) * 0.1 for _ in range(steps)]

    def trajectory(make) -> torch.Tensor:
        param = torch.nn.Parameter(torch.zeros(numel, dtype=make[1]))
        opt = make[0]([param])
        for t in range(steps):
            param.grad = (param.detach().double() - target + noise[t]).to(param.dtype)
            opt.step()
        return param.detach().double()

    ref = trajectory((lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0), torch.float64))
    ours = trajectory((lambda p: BlockwiseAdamW(p, lr=lr), torch.float32))
    fp32 = trajectory((lambda p: AdamW(p, lr=lr), torch.float32))
    moved = ref.norm()
    assert float((ours - ref).norm() / moved) < 0.05
    assert float((fp32 - ref).norm() / moved) < 1e-4


def test_bad_arguments_are_refused():
    param = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="master"):
        BlockwiseAdamW([param], master_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_size"):
        BlockwiseAdamW([param], block_size=0)
