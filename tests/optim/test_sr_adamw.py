"""StochasticRoundingAdamW against torchao's ``_AdamW(bf16_stochastic_round=True)`` fed the
same random bits, against float64 predictions of what stochastic rounding keeps in
expectation, and its chunking, resume, streams and EDQ rows.

Tests taking ``device`` run on the suite's device (``pytest --device cuda``: the GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchao.optim
from torchao.optim.quant_utils import _fp32_to_bf16_sr

from collage_train.metrics.edq import FIELDS, edq_metrics, edq_partials, partials_close
from collage_train.optim import CollageAdamW, rounding_noise
from collage_train.optim.sr_adamw import StochasticRoundingAdamW

BETAS = (0.9, 0.999)
SIGMAS = 5.0  # statistical bounds: a fixed-seed test outside 5 sigma would be a 1-in-1.7e6 event


def _global_draws(numel, stream, step, offset, device):
    """torchao's draws: 16-bit integers from the global generator, as the top of 32 bits."""
    return torch.randint(0, 1 << 16, (numel,), dtype=torch.int32).to(device, torch.int64) << 16


def _params(shapes, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device, torch.bfloat16)) for s in shapes
    ]


def _grads(shapes, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]


# ---------------------------------------------------------------- torchao, same bits


def test_rounding_rule_is_torchaos_given_the_same_16_bit_draws():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1 << 16, generator=gen) * torch.logspace(-20, 20, 1 << 16)
    x[:256] = x[:256].bfloat16().float()  # already representable: must stay exact
    torch.manual_seed(11)
    expected = _fp32_to_bf16_sr(x.clone())
    torch.manual_seed(11)
    draws = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32).to(torch.int64)
    junk = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int64)
    ours = rounding_noise.stochastic_round_to_bf16(x, (draws << 16) | junk)  # low bits unused
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(ours[:256], x[:256].bfloat16())
    rounded_up = ours.float().abs() > x.abs()
    assert 0.3 < rounded_up[256:].float().mean() < 0.7  # both directions occur


def _torchao_adamw(params, lr, weight_decay, fp64_scalars):
    """torchao's optimizer on ``params``; with ``fp64_scalars`` its lr and step counters
    are float64 tensors, so that lr * wd, 1 - beta^t and sqrt(c2) are the float64 values
    this project computes on the host (its own fp32 tensors round them first)."""
    if not fp64_scalars:
        return torchao.optim._AdamW(
            params, lr=lr, betas=BETAS, weight_decay=weight_decay, bf16_stochastic_round=True
        )
    opt = torchao.optim._AdamW(
        params,
        lr=torch.tensor(lr, dtype=torch.float64),
        betas=BETAS,
        weight_decay=weight_decay,
        bf16_stochastic_round=True,
    )
    for p in params:
        opt.state[p].update(
            step=torch.tensor(0.0, dtype=torch.float64),
            exp_avg=torch.zeros_like(p),
            exp_avg_sq=torch.zeros_like(p),
        )
    return opt


def _step_both(theirs, ours, their_params, our_params, grads, draw_seed):
    for a, b, g in zip(their_params, our_params, grads, strict=True):
        a.grad, b.grad = g.clone(), g.clone()
    with torch.compiler.set_stance("force_eager"):  # torchao's step, uncompiled
        torch.manual_seed(draw_seed)
        theirs.step()
    torch.manual_seed(draw_seed)
    ours.step()


def test_steps_match_torchao_bitwise_with_float64_scalars():
    """Five steps, weight decay on, three tensors: weights and moments bit for bit."""
    shapes = [(64, 33), (1000,), (7,)]
    theirs_p, ours_p = _params(shapes, 0), _params(shapes, 0)
    theirs = _torchao_adamw(theirs_p, 3e-3, 0.1, fp64_scalars=True)
    ours = StochasticRoundingAdamW(ours_p, lr=3e-3, betas=BETAS, weight_decay=0.1)
    ours.bits_source = _global_draws
    start = [p.detach().clone() for p in ours_p]
    for step in range(5):
        _step_both(theirs, ours, theirs_p, ours_p, _grads(shapes, 10 + step), 100 + step)
        for a, b in zip(theirs_p, ours_p, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), step
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(theirs.state[a][key], ours.state[b][key]), (step, key)
    assert all(not torch.equal(p, s) for p, s in zip(ours_p, start, strict=True))


def test_torchaos_own_fp32_scalars_move_a_few_roundings_by_one_ulp():
    """With torchao's defaults (fp32 lr and step tensors) lr * wd and the bias corrections
    are rounded to fp32 before use, so the fp32 target differs in its last bits; SR then
    rounds the other way only where the draw falls between the two targets. One step of
    2^18 weights: moments still bitwise, weights adjacent bf16 values in < 0.1% of places."""
    shapes = [(1 << 18,)]
    theirs_p, ours_p = _params(shapes, 1), _params(shapes, 1)
    theirs = _torchao_adamw(theirs_p, 3e-3, 0.1, fp64_scalars=False)
    ours = StochasticRoundingAdamW(ours_p, lr=3e-3, betas=BETAS, weight_decay=0.1)
    ours.bits_source = _global_draws
    _step_both(theirs, ours, theirs_p, ours_p, _grads(shapes, 2), 7)
    a, b = theirs_p[0].detach(), ours_p[0].detach()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(theirs.state[theirs_p[0]][key], ours.state[ours_p[0]][key])
    differ = a != b
    assert differ.float().mean() < 1e-3
    bit_distance = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    assert torch.all(bit_distance[differ] == 1)


# ---------------------------------------------------------------- float64 predictions

ULP = 2.0**-7  # bf16 spacing on [1, 2)
N_STAT = 1 << 19


def _sub_ulp_problem(device):
    """Weights in [1.1, 1.9] (no power of two within reach) and one AdamW step whose
    update, lr * (g / |g| + wd * theta), lies between 0.2 and 0.46 of an ulp."""
    gen = torch.Generator().manual_seed(5)
    theta = (1.1 + 0.8 * torch.rand(N_STAT, generator=gen)).bfloat16()
    grad = torch.randn(N_STAT, generator=gen).bfloat16()
    lr, wd = 3e-3, 0.1
    t64, g64 = theta.double(), grad.double()
    m = (1 - BETAS[0]) * g64 / (1 - BETAS[0])
    v = (1 - BETAS[1]) * g64 * g64 / (1 - BETAS[1])
    intended = -lr * wd * t64 - lr * m / (v.sqrt() + 1e-8)
    return theta.to(device), grad.to(device), lr, wd, intended.to(device)


def _one_tracked_step(optimizer_class, theta, grad, lr, wd, **extra):
    param = torch.nn.Parameter(theta.clone())
    opt = optimizer_class([param], lr=lr, betas=BETAS, weight_decay=wd, **extra)
    opt.track_edq = True
    param.grad = grad.clone()
    opt.step()
    return param.detach().double() - theta.double(), opt


def test_expected_change_is_the_float64_update_for_updates_below_an_ulp(device):
    theta, grad, lr, wd, intended = _sub_ulp_problem(device)
    q = intended.abs() / ULP  # probability of moving one ulp
    assert q.min() > 0.2 and q.max() < 0.5
    change, _ = _one_tracked_step(StochasticRoundingAdamW, theta, grad, lr, wd, seed=1)
    assert torch.all((change == 0) | ((change.abs() == ULP) & (change.sign() == intended.sign())))
    sigma = ULP * (q * (1 - q)).sum().sqrt()  # sd of sum(change - E[change])
    assert (change - intended).sum().abs() <= SIGMAS * sigma
    # the same per sign of the update (the two directions are separate binomials)
    for side in (intended > 0, intended < 0):
        s = ULP * (q[side] * (1 - q[side])).sum().sqrt()
        assert (change[side] - intended[side]).sum().abs() <= SIGMAS * s


def test_edq_and_lost_fraction_match_their_float64_expectation(device):
    """Normalised EDQ = <D, u> / ||u||^2 has expectation 1 (E[D] = u); an element is lost
    when SR rounds back, with probability 1 - |u| / ulp. Round to nearest (CollageAdamW in
    mode "none", plain bf16) loses every one of these updates."""
    theta, grad, lr, wd, intended = _sub_ulp_problem(device)
    q = intended.abs() / ULP
    _, opt = _one_tracked_step(StochasticRoundingAdamW, theta, grad, lr, wd, seed=2)
    metrics = opt.edq_metrics()
    norm_sq = (intended * intended).sum()
    edq_sigma = ((intended * intended * ULP * ULP * q * (1 - q)).sum().sqrt() / norm_sq).item()
    assert abs(metrics["edq_normalized"] - 1.0) <= SIGMAS * edq_sigma
    lost_expected = (1 - q).mean().item()
    lost_sigma = ((q * (1 - q)).sum().sqrt() / N_STAT).item()
    assert abs(metrics["lost_update_frac"] - lost_expected) <= SIGMAS * lost_sigma

    _, nearest = _one_tracked_step(CollageAdamW, theta, grad, lr, wd, mode="none", kernel="eager")
    contrast = nearest.edq_metrics()
    assert contrast["lost_update_frac"] == 1.0 and contrast["edq_normalized"] == 0.0


# ---------------------------------------------------------------- chunks, resume, streams


def _run(params, grads_per_step, *, chunk=None, seed=0, track=False, segments=None, lr=1e-2):
    opt = StochasticRoundingAdamW(params, lr=lr, betas=BETAS, weight_decay=0.1, seed=seed)
    if chunk is not None:
        opt.step_chunk_numel = chunk
    if segments:
        opt.edq_segments.update(segments)
    opt.track_edq = track
    edq = []
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        edq.append({i: opt.last_edq[p].clone() for i, p in enumerate(params) if p in opt.last_edq})
    return opt, edq


def test_chunked_steps_equal_whole_steps_bitwise(device):
    shapes = [(3001,), (40, 50), (5,)]
    steps = [_grads(shapes, 20 + i, device) for i in range(4)]
    whole_p, chunked_p = _params(shapes, 3, device), _params(shapes, 3, device)
    whole, whole_edq = _run(whole_p, steps, track=True)
    chunked, chunked_edq = _run(chunked_p, steps, chunk=333, track=True)
    for a, b in zip(whole_p, chunked_p, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(whole.state[a][key], chunked.state[b][key])
    for w, c in zip(whole_edq, chunked_edq, strict=True):
        assert all(partials_close(w[i], c[i]) for i in w)
        assert w.keys() == c.keys() == {0, 1, 2}


def test_a_transposed_parameter_steps_as_its_contiguous_copy(device):
    base = _params([(30, 20)], 4, device)[0]
    strided = torch.nn.Parameter(base.detach().t())  # not contiguous: one piece, row-major bits
    dense = torch.nn.Parameter(base.detach().t().contiguous())
    grad = _grads([(20, 30)], 5, device)[0]
    _run([strided], [[grad]] * 2, chunk=64)
    _run([dense], [[grad]] * 2, chunk=64)
    assert not strided.is_contiguous()
    assert torch.equal(strided.view(torch.int16), dense.view(torch.int16))


def test_resume_from_state_dict_continues_bitwise(device):
    shapes = [(2000,), (16, 16)]
    steps = [_grads(shapes, 30 + i, device) for i in range(6)]
    straight_p = _params(shapes, 6, device)
    _run(straight_p, steps)

    first_p = _params(shapes, 6, device)
    first, _ = _run(first_p, steps[:3])
    saved_state = copy.deepcopy(first.state_dict())
    saved_weights = [p.detach().clone() for p in first_p]
    resumed_p = [torch.nn.Parameter(w) for w in saved_weights]
    resumed = StochasticRoundingAdamW(resumed_p, lr=1e-2, betas=BETAS, weight_decay=0.1)
    resumed.load_state_dict(saved_state)
    assert [resumed.state[p]["stream"] for p in resumed_p] == [0, 1]
    assert [resumed.state[p]["step"] for p in resumed_p] == [3, 3]
    for p in resumed_p:
        assert resumed.state[p]["exp_avg"].dtype == torch.bfloat16
    for grads in steps[3:]:
        for p, g in zip(resumed_p, grads, strict=True):
            p.grad = g.clone()
        resumed.step()
    for a, b in zip(resumed_p, straight_p, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # a tensor added after the restore does not reuse a restored stream
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device=device))
    resumed.add_param_group({"params": [extra]})
    extra.grad = torch.ones_like(extra)
    resumed.step()
    assert resumed.state[extra]["stream"] == 2


def test_a_state_restored_without_streams_gets_fresh_ones(device):
    """An elastic resume fills each tensor's moments and step from the rank-independent
    state but no stream (streams named the writer's tensors): the step draws new ones, in
    order, and keeps the restored moments and step."""
    shapes = [(300,), (8, 8)]
    first_p = _params(shapes, 6, device)
    first, _ = _run(first_p, [_grads(shapes, 40, device)])
    params = [torch.nn.Parameter(p.detach().clone()) for p in first_p]
    opt = StochasticRoundingAdamW(params, lr=1e-2, betas=BETAS, weight_decay=0.1)
    for p, old in zip(params, first_p, strict=True):  # as ZeroEngine/SingleProcessEngine.load_full
        kept = first.state[old]
        opt.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                        for k, v in kept.items() if k != "stream"}  # fmt: skip
    for p, g in zip(params, _grads(shapes, 41, device), strict=True):
        p.grad = g
    opt.step()
    assert [opt.state[p]["stream"] for p in params] == [0, 1]
    assert [opt.state[p]["step"] for p in params] == [2, 2]


def test_seeds_and_streams_give_different_bits(device):
    """Same values, same gradients: the rounding pattern changes with the seed and
    between tensors (streams), and repeats for the same seed."""
    value = torch.full((4096,), 1.5, dtype=torch.bfloat16, device=device)
    grad = torch.ones(4096, dtype=torch.bfloat16, device=device)

    def rounded(seed, copies=1):
        params = [torch.nn.Parameter(value.clone()) for _ in range(copies)]
        opt, _ = _run(params, [[grad] * copies], seed=seed, lr=3e-3)
        return [p.detach().clone() for p in params], opt, params

    (a,), _, _ = rounded(0)
    (again,), _, _ = rounded(0)
    (other,), _, _ = rounded(1)
    (x, y), opt, params = rounded(0, copies=2)
    assert torch.equal(a, again) and torch.equal(a, x)
    assert not torch.equal(a, other)
    assert not torch.equal(x, y)
    assert [opt.state[p]["stream"] for p in params] == [0, 1]
    for result in (a, other, y):  # lr * 1.15 = 0.44 ulp of 1.5
        moved = (result != value).float().mean().item()
        assert 0.35 < moved < 0.53


def test_edq_rows_follow_the_segments_of_a_flat_partition(device):
    flat = _params([(1000,)], 8, device)
    grads = [_grads([(1000,)], 9, device)]
    segments = [("embeddings", 0, 300), ("block_0", 300, 710), ("head", 710, 1000)]
    before = flat[0].detach().clone()
    _, edq = _run(flat, grads, chunk=128, track=True, segments={flat[0]: segments})
    rows = edq[0][0]
    assert rows.shape == (len(segments), len(FIELDS))
    after = flat[0].detach()
    for row, (_, start, stop) in zip(rows, segments, strict=True):
        moved = after[start:stop] != before[start:stop]
        assert row[FIELDS.index("nonzero")] == stop - start
        assert row[FIELDS.index("lost")] == (~moved).sum()
    unsegmented_p = _params([(1000,)], 8, device)
    _, whole = _run(unsegmented_p, grads, track=True)
    assert torch.equal(unsegmented_p[0], flat[0])
    assert partials_close(rows.sum(dim=0), whole[0][0])
    # the sums behind each row: recomputed from the weights and the float64 update
    g = grads[0][0].double()
    intended = -1e-2 * 0.1 * before.double() - 1e-2 * g / (g.abs() + 1e-8)
    for row, (_, start, stop) in zip(rows, segments, strict=True):
        reference = edq_partials(before[start:stop], after[start:stop], intended[start:stop])
        assert torch.allclose(row[:4].double(), reference[:4].double(), rtol=1e-4)
    assert abs(edq_metrics(rows.sum(dim=0), False)["edq_normalized"] - 1.0) < 0.1


def test_empty_parameters_and_an_empty_segment_list(device):
    empty = torch.nn.Parameter(torch.zeros(0, dtype=torch.bfloat16, device=device))
    flat = _params([(50,)], 10, device)[0]
    opt, edq = _run(
        [empty, flat],
        [[torch.zeros(0, dtype=torch.bfloat16, device=device), _grads([(50,)], 11, device)[0]]],
        track=True,
        segments={flat: []},
    )
    assert opt.state[empty]["step"] == 1 and opt.state[flat]["step"] == 1
    assert edq[0][1].shape == (0, len(FIELDS))


def test_full_precision_is_the_bf16_weight_and_loads_round_to_nearest(device):
    param = _params([(257,)], 12, device)[0]
    opt = StochasticRoundingAdamW([param], lr=1e-3)
    [value] = opt.full_precision_weights()
    assert value.dtype == torch.float32 and torch.equal(value, param.detach().float())
    target = torch.randn(257, generator=torch.Generator().manual_seed(13)).to(device)
    opt.load_full_precision_weights([target])
    assert torch.equal(param.detach(), target.to(torch.bfloat16))
    assert not torch.equal(param.detach().float(), target)  # rounded, not stored exactly


def test_refuses_fp32_parameters():
    with pytest.raises(TypeError, match="needs bf16 parameters"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.zeros(3))])
