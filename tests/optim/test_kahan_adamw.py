"""KahanAdamW against torch-optimi's ``AdamW(kahan_sum=True)`` bit for bit, and its
compensated weights against float64 sums.

Tests taking ``device`` run on the suite's device (``pytest --device cuda``: the GPU)."""

from __future__ import annotations

import copy
import io

import optimi
import pytest
import torch

from collage_train.metrics.edq import FIELDS, edq_partials, partials_close
from collage_train.optim import CollageAdamW
from collage_train.optim.kahan_adamw import KahanAdamW, debiased_beta

BF16 = torch.bfloat16
SHAPES = [(64,), (63,), (1000,), (33, 47), (40007,), (5,)]  # tails; > 32768: threads split it


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().view(torch.int16)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(_bits(a), _bits(b)), f"{int((_bits(a) != _bits(b)).sum())} differ"


def _tensors(shapes, gen, device, spread=1.0):
    """bf16 tensors of widely varying magnitude (log-normal)."""
    return [
        (torch.randn(s, generator=gen) * torch.exp(spread * torch.randn(s, generator=gen)))
        .to(BF16)
        .to(device)
        for s in shapes
    ]


# ------------------------------------------------------------------ against optimi


def _run_both(device, *, foreach: bool, weight_decay: float, lr: float, steps: int = 12):
    """Ours (stepped 1000 elements at a time) and optimi's on the same bf16 tensors and
    gradients, with a varying lr and a second param group without weight decay."""
    gen = torch.Generator().manual_seed(1)
    init = _tensors(SHAPES, gen, device)
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]

    def groups(params):
        return [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]

    hyper = {"lr": lr, "betas": (0.9, 0.99), "weight_decay": weight_decay, "eps": 1e-6}
    reference = optimi.AdamW(
        groups(theirs), **hyper, decouple_lr=False, kahan_sum=True, foreach=foreach, triton=False
    )
    optimizer = KahanAdamW(groups(ours), **hyper)
    optimizer.step_chunk_numel = 1000
    for _ in range(steps):
        lr_t = lr * (0.5 + torch.rand(1, generator=gen).item())
        for opt in (reference, optimizer):
            for group in opt.param_groups:
                group["lr"] = lr_t
        for a, b, g in zip(ours, theirs, _tensors(SHAPES, gen, device, spread=2.0), strict=True):
            a.grad, b.grad = g.clone(), g.clone()  # optimi uses its grads as scratch
        reference.step()
        optimizer.step()
    return ours, theirs, optimizer, reference


def _assert_same_state(ours, theirs, optimizer, reference):
    for a, b in zip(ours, theirs, strict=True):
        _assert_same_bits(a, b)
        for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
            _assert_same_bits(optimizer.state[a][key], reference.state[b][key])


@pytest.mark.parametrize(("weight_decay", "lr"), [(0.1, 1e-3), (0.5, 1e-2), (0.0, 1e-2)])
def test_bitwise_equal_to_optimi_for_loop_path(device, weight_decay, lr):
    """Weights, m, v and c after 12 steps: same bits as optimi's for-loop path. With
    lr * wd = 5e-3 (above bf16's 2^-9) weight decay changes the weights, so its
    convention (1 - lr * wd on the bf16 weight, optimi's decouple_lr=False) is checked."""
    ours, theirs, optimizer, reference = _run_both(
        device, foreach=False, weight_decay=weight_decay, lr=lr
    )
    _assert_same_state(ours, theirs, optimizer, reference)
    if lr * weight_decay > 2**-9:
        undecayed, *_ = _run_both(device, foreach=False, weight_decay=0.0, lr=lr)
        assert not torch.equal(ours[0], undecayed[0])


def test_bitwise_equal_to_optimi_foreach_path_with_fp32_scalars(device, monkeypatch):
    """optimi's foreach path computes the same, given ``_foreach_mul_`` multiplies by the
    fp32 scalar as ``mul_`` does. torch 2.13's CPU ``_foreach_mul_`` rounds the scalar to
    bf16 first (b2_hat and 1 - lr * wd), so here it is replaced by per-tensor ``mul_``."""

    def mul_each(tensors, scalar):
        for tensor in tensors:
            tensor.mul_(scalar)

    monkeypatch.setattr(torch, "_foreach_mul_", mul_each)
    _assert_same_state(*_run_both(device, foreach=True, weight_decay=0.5, lr=1e-2))


def test_bias_corrections_are_optimis_float64_debiased_betas():
    """b_hat_t = b (1 - b^(t-1)) / (1 - b^t), so the stored moments are Adam's
    bias-corrected ones; the same float64 values as optimi's own function."""
    from optimi.utils import debias_beta

    for beta in (0.9, 0.95, 0.999):
        for step in (1, 2, 3, 10, 1000, 100_000):
            assert debiased_beta(beta, step) == debias_beta(beta, step)
            exact = beta * (1 - beta ** (step - 1)) / (1 - beta**step)
            assert debiased_beta(beta, step) == pytest.approx(exact, rel=1e-12, abs=1e-300)


# ------------------------------------------------------- float64 reference, sub-ulp updates

N, STEPS = 4096, 400


def _sub_ulp_problem(device):
    """Weights of magnitude 0.5 to 4, gradients of +-1 and lr ~ 2^-12 (a 32nd to a 256th of
    a bf16 ulp of the weights): m stays g, v stays 1, so each step's intended update is
    exactly -fp32(lr) * g and its float64 sum is the true trajectory."""
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(N, generator=gen) < 0.5, -1.0, 1.0)
    start = (sign * (0.5 + 3.5 * torch.rand(N, generator=gen))).to(BF16).to(device)
    grad = torch.where(torch.rand(N, generator=gen) < 0.5, -1.0, 1.0).to(BF16).to(device)
    lrs = [(0.5 + torch.rand(1, generator=gen).item()) * 2**-12 for _ in range(STEPS)]
    return start, grad, lrs


def _fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def test_compensated_weight_tracks_the_float64_sum_of_sub_ulp_updates(device):
    """Each step, theta + c moves by the intended update to within 2^-16 of the weight
    (half an ulp of the bf16 c, |c| < one ulp of theta); after 400 steps the error is a
    random walk of those roundings. Plain bf16 (CollageAdamW mode none) never moves."""
    start, grad, lrs = _sub_ulp_problem(device)
    param = torch.nn.Parameter(start.clone())
    plain = torch.nn.Parameter(start.clone())
    optimizer = KahanAdamW([param], lr=1.0)
    plain_optimizer = CollageAdamW([plain], lr=1.0, mode="none", kernel="eager")
    reference = previous = start.double()
    for lr in lrs:
        for opt, weight in ((optimizer, param), (plain_optimizer, plain)):
            opt.param_groups[0]["lr"] = lr
            weight.grad = grad.clone()
            opt.step()
        intended = -_fp32(lr) * grad.double()
        reference = reference + intended
        now = optimizer.full_precision_weights()[0].double()
        scale = torch.maximum(previous.abs(), now.abs())
        assert ((now - previous - intended).abs() <= 2**-16 * scale).all()
        previous = now
    state = optimizer.state[param]
    assert torch.equal(state["exp_avg"], grad) and bool((state["exp_avg_sq"] == 1).all())

    relative = (previous - reference) / reference.abs()
    rms_bound = (STEPS / 3) ** 0.5 * 2**-16  # STEPS independent errors of at most 2^-16
    assert relative.pow(2).mean().sqrt() <= rms_bound
    assert torch.equal(plain.detach(), start)  # every update rounded away
    plain_relative = (plain.double() - reference) / reference.abs()
    assert plain_relative.pow(2).mean().sqrt() > 100 * rms_bound
    assert not torch.equal(param.detach(), start)  # the compensation carried into theta


def test_compensation_sign_convention(device):
    """c holds what the weight has still to take: full precision = theta + c."""
    param = torch.nn.Parameter(torch.ones(3, dtype=BF16, device=device))
    optimizer = KahanAdamW([param], lr=2**-10)
    param.grad = torch.ones_like(param)
    optimizer.step()  # intended update -2^-10, under half an ulp (2^-8) of 1.0
    assert torch.equal(param.detach(), torch.ones_like(param))
    assert (optimizer.state[param]["kahan_comp"] == -(2**-10)).all()
    assert (optimizer.full_precision_weights()[0] == 1 - 2**-10).all()


# ---------------------------------------------------------------- chunks, resume, replicas


def _model_params(device):
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(t) for t in _tensors([(4099,), (37, 29), (0,)], gen, device)]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(BF16).to(p.device) for p in params]


def _steps(optimizer, params, first, last, track=False):
    for step in range(first, last):
        for param, grad in zip(params, _grads(params, step), strict=True):
            param.grad = grad
        optimizer.track_edq = track
        optimizer.step()


@pytest.mark.parametrize("track", [False, True])
def test_chunked_step_is_bitwise_the_whole_step(device, track):
    runs = []
    for chunk in (1 << 22, 1000, 64, 7):
        params = _model_params(device)
        optimizer = KahanAdamW(params, lr=3e-3, weight_decay=0.1)
        optimizer.step_chunk_numel = chunk
        _steps(optimizer, params, 0, 5, track=track)
        runs.append((params, optimizer))
    whole_params, whole = runs[0]
    for params, optimizer in runs[1:]:
        _assert_same_state(params, whole_params, optimizer, whole)
        if track:
            for a, b in zip(params[:2], whole_params[:2], strict=True):
                assert partials_close(optimizer.last_edq[a], whole.last_edq[b])


def test_state_dict_round_trip_then_continuing_is_bitwise(device):
    params = _model_params(device)
    optimizer = KahanAdamW(params, lr=3e-3, weight_decay=0.1)
    _steps(optimizer, params, 0, 6)

    resumed_params = _model_params(device)
    resumed = KahanAdamW(resumed_params, lr=3e-3, weight_decay=0.1)
    _steps(resumed, resumed_params, 0, 3)
    buffer = io.BytesIO()
    torch.save(resumed.state_dict(), buffer)
    weights = [p.detach().clone() for p in resumed_params]
    buffer.seek(0)

    fresh_params = [torch.nn.Parameter(w) for w in weights]
    fresh = KahanAdamW(fresh_params, lr=1.0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.param_groups[0]["lr"] == 3e-3
    state = fresh.state[fresh_params[1]]
    assert state["step"] == 3 and all(state[k].dtype == BF16 for k in ("exp_avg", "kahan_comp"))
    _steps(fresh, fresh_params, 3, 6)
    _assert_same_state(fresh_params, params, fresh, optimizer)


def test_full_precision_read_and_load_round_trip(device):
    params = _model_params(device)
    optimizer = KahanAdamW(params, lr=3e-3)
    assert torch.equal(optimizer.full_precision_weights()[0], params[0].float())  # no state yet
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(p.shape, generator=gen, dtype=torch.float32).to(device) for p in params]
    optimizer.load_full_precision_weights(values)
    for param, value in zip(params, values, strict=True):
        _assert_same_bits(param, value.to(BF16))
        comp = optimizer.state[param]["kahan_comp"]
        _assert_same_bits(comp, (value - value.to(BF16).float()).to(BF16))
    read = optimizer.full_precision_weights()
    for value, back in zip(values, read, strict=True):
        # theta = bf16(value) and c = bf16(value - theta) each err by at most 2^-8 relative
        assert ((back - value).abs() <= 2**-16 * value.abs()).all()
    optimizer.load_full_precision_weights(read)  # reading back and loading keeps the value
    for value, again in zip(read, optimizer.full_precision_weights(), strict=True):
        _assert_same_bits(again, value)  # (theta may move to the other neighbour at a tie)

    # Replicas loading the same full-precision weights continue exactly alike.
    _steps(optimizer, params, 0, 2)
    shared = [w + 1e-3 for w in optimizer.full_precision_weights()]
    replica_params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    replica = KahanAdamW(replica_params, lr=3e-3)
    replica.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for opt in (optimizer, replica):
        opt.load_full_precision_weights(shared)
    _steps(optimizer, params, 2, 4)
    _steps(replica, replica_params, 2, 4)
    _assert_same_state(replica_params, params, replica, optimizer)


# ------------------------------------------------------------------------------ EDQ


def test_edq_rows_of_a_flat_partition(device):
    """One row per edq_segments range: realised = the bf16 weight's change, intended =
    -lr g / d - lr wd theta (d = 1 here), low part = c; rows sum to the unsegmented
    partials, and tracking leaves the numerics bitwise unchanged."""
    start, grad, _ = _sub_ulp_problem(device)
    lr, weight_decay = 2**-9, 0.25
    segments = [("embeddings", 0, 1000), ("block_0", 1000, 1001), ("head", 1001, N)]
    results = {}
    for name, segs in (("rows", segments), ("whole", None), ("untracked", None)):
        param = torch.nn.Parameter(start.clone())
        optimizer = KahanAdamW([param], lr=lr, weight_decay=weight_decay)
        optimizer.step_chunk_numel = 300  # chunks straddle the segments
        if segs is not None:
            optimizer.edq_segments[param] = segs
        for _ in range(3):
            before = param.detach().clone()
            param.grad = grad.clone()
            optimizer.track_edq = name != "untracked"
            optimizer.step()
        results[name] = (param, optimizer, before)

    param, optimizer, before = results["rows"]
    rows = optimizer.last_edq[param]
    assert rows.shape == (len(segments), len(FIELDS))
    intended = -_fp32(lr) * grad.float() + _fp32(-lr * weight_decay) * before.float()
    comp = optimizer.state[param]["kahan_comp"]
    for row, (_, first, last) in zip(rows, segments, strict=True):
        expected = edq_partials(
            before[first:last], param[first:last], intended[first:last], comp[first:last]
        )
        assert partials_close(row, expected)
    whole_param, whole, _ = results["whole"]
    assert partials_close(rows.sum(dim=0), whole.last_edq[whole_param])
    metrics = optimizer.edq_metrics()
    assert 0 < metrics["lost_update_frac"] < 1 and metrics["dtheta_norm"] > 0
    untracked_param, untracked, _ = results["untracked"]
    _assert_same_state([param], [untracked_param], optimizer, untracked)
    assert untracked.last_edq == {}


# ------------------------------------------------------------------ shapes and refusals


def test_empty_and_flat_params_and_state_bytes(device):
    flat = torch.nn.Parameter(torch.randn(10_000, device=device).to(BF16))
    empty = torch.nn.Parameter(torch.zeros(0, dtype=BF16, device=device))
    optimizer = KahanAdamW([flat, empty], lr=1e-3)
    optimizer.edq_segments[flat] = [("block_0", 0, 6000), ("block_1", 6000, 10_000)]
    optimizer.step_chunk_numel = 4096
    for _ in range(2):
        flat.grad, empty.grad = torch.randn_like(flat), torch.zeros_like(empty)
        optimizer.track_edq = True
        optimizer.step()
    assert optimizer.state[empty]["step"] == 2 and empty not in optimizer.last_edq
    assert optimizer.last_edq[flat].shape == (2, len(FIELDS))
    state_bytes = sum(
        t.element_size() for t in optimizer.state[flat].values() if torch.is_tensor(t)
    )
    assert state_bytes + flat.element_size() + flat.grad.element_size() == 10


def test_refuses_non_bf16_params():
    with pytest.raises(TypeError, match="bf16"):
        KahanAdamW([torch.nn.Parameter(torch.zeros(3))])
