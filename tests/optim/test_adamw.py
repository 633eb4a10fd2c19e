"""AdamW: float64 reference agreement, master weights, state round trip."""

import math

import pytest
import torch

from collage_train.optim import AdamW, CollageAdamW


def reference_adamw(theta, grads, lr, betas, eps, wd):
    """Textbook AdamW in float64 on plain Python floats per element (via tensors)."""
    theta = theta.double().clone()
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        theta *= 1 - lr * wd
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat = m / (1 - betas[0] ** t)
        v_hat = v / (1 - betas[1] ** t)
        theta -= lr * m_hat / (v_hat.sqrt() + eps)
    return theta


def run(dtype, master_dtype, steps=50, lr=1e-2, wd=0.1):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    grads = [torch.randn(64, 32, generator=gen, dtype=torch.float64) for _ in range(steps)]
    param = torch.nn.Parameter(start.to(dtype, copy=True))
    opt = AdamW(
        [param], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, master_dtype=master_dtype
    )
    for g in grads:
        param.grad = g.to(dtype)
        opt.step()
    ref = reference_adamw(start.to(dtype), [g.to(dtype) for g in grads], lr, (0.9, 0.95), 1e-8, wd)
    return param, opt, ref


def test_fp32_matches_float64_reference():
    param, _, ref = run(torch.float32, None)
    assert torch.allclose(param.double(), ref, rtol=0, atol=1e-5)


def test_float64_params_match_reference_to_rounding():
    param, _, ref = run(torch.float64, None)
    assert torch.allclose(param, ref, rtol=0, atol=1e-12)


def test_master_weights_are_fp32_and_params_their_rounding():
    param, opt, ref = run(torch.bfloat16, torch.float32)
    state = opt.state[param]
    assert state["master"].dtype == torch.float32
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(param.detach(), state["master"].to(torch.bfloat16))
    # Master trajectory tracks float64 (grads are the same bf16 values in both).
    assert (state["master"].double() - ref).abs().max() < 1e-5


def test_plain_bf16_loses_small_updates_that_master_keeps():
    # lr * update ~ 1e-4 of weights ~ 1: below bf16's half-ulp, so plain bf16 never moves.
    param = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    master_param = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    plain = AdamW([param], lr=1e-4, master_dtype=None)
    mixed = AdamW([master_param], lr=1e-4, master_dtype=torch.float32)
    for _ in range(100):
        param.grad = torch.ones_like(param)
        master_param.grad = torch.ones_like(master_param)
        plain.step()
        mixed.step()
    assert torch.equal(param.detach(), torch.ones_like(param))
    assert master_param.detach().float().max() < 1.0  # 100 x 1e-4 accumulated, then rounded


def test_step_count_is_integer_beyond_bf16_range():
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = AdamW([param], lr=0.0)
    for _ in range(300):
        param.grad = torch.ones_like(param)
        opt.step()
    assert opt.state[param]["step"] == 300 and isinstance(opt.state[param]["step"], int)


def test_state_dict_round_trip_keeps_fp32_state_exactly():
    param, opt, _ = run(torch.bfloat16, torch.float32, steps=5)
    saved = opt.state_dict()
    fresh_param = torch.nn.Parameter(param.detach().clone())
    fresh = AdamW(
        [fresh_param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, master_dtype=torch.float32
    )
    fresh.load_state_dict(saved)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert fresh.state[fresh_param][key].dtype == torch.float32
        assert torch.equal(fresh.state[fresh_param][key], opt.state[param][key])
    assert fresh.state[fresh_param]["step"] == 5
    g = torch.randn(64, 32).to(torch.bfloat16)
    param.grad, fresh_param.grad = g.clone(), g.clone()
    opt.step()
    fresh.step()
    assert torch.equal(param, fresh_param)


def test_load_state_dict_rejects_wrong_shapes():
    _param, opt, _ = run(torch.float32, None, steps=1)
    other = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="shape"):
        AdamW([other]).load_state_dict(opt.state_dict())


def test_params_without_grad_are_untouched():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([a, b], lr=0.1, weight_decay=0.5)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3)) and b not in opt.state
    assert not math.isclose(a[0].item(), 1.0)


@pytest.mark.parametrize("optimizer", [AdamW, CollageAdamW])
def test_invalid_hyperparameters_are_rejected(optimizer):
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hyper-parameters"):
        optimizer([param], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        optimizer([param], betas=(0.9, 1.0))


def _adamw_run(chunk: int, *, master: bool, view: bool):
    """Four steps (two tracked) of AdamW on two whole tensors and one flat partition."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if master else torch.float32
    params = [
        torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.05).to(dtype))
        for shape in ((40, 30), (700,), (5000,))
    ]
    optimizer = AdamW(
        params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
        master_dtype=torch.float32 if master else None,
    )  # fmt: skip
    optimizer.step_chunk_numel = chunk
    optimizer.edq_segments = {params[-1]: [("a", 0, 1200), ("b", 1200, 4900)]}
    if view:  # ZeRO hands mixed_fp32's fp32 masters: EDQ on their bf16 rounding
        optimizer.edq_view_dtype = torch.bfloat16
    sums = []
    for step in range(4):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
        optimizer.track_edq = step % 2 == 1
        optimizer.step()
        if optimizer.track_edq:
            sums.append([optimizer.last_edq[p] for p in params])
    return params, optimizer, sums


@pytest.mark.parametrize(("master", "view"), [(True, False), (False, True), (False, False)])
def test_tracked_steps_in_chunks_change_no_bit(master, view):
    """Chunks of 97 elements against one pass: the same weights, masters and moments
    bitwise; the same EDQ sums to fp32 rounding, per segment of a flat partition."""
    from collage_train.metrics.edq import partials_close

    whole, whole_opt, whole_sums = _adamw_run(1 << 22, master=master, view=view)
    chunked, chunked_opt, chunked_sums = _adamw_run(97, master=master, view=view)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)
        for key, value in whole_opt.state[a].items():
            other = chunked_opt.state[b][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
    rows = chunked_sums[-1][-1]
    assert rows.shape == (2, 6)
    assert rows[:, 2].tolist() == [1200.0, 3700.0]  # the padding tail is stepped, not counted
    assert bool((rows[:, 0] > 0).all())  # realised change against the weights before
    for step_a, step_b in zip(whole_sums, chunked_sums, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            for row_a, row_b in zip(a.reshape(-1, 6), b.reshape(-1, 6), strict=True):
                assert partials_close(row_a, row_b)


def test_tracking_an_fp32_partition_allocates_one_chunk_not_the_partition():
    """mixed_fp32 under ZeRO: AdamW steps one fp32 flat partition; tracking EDQ used to
    copy it whole (and round it and the result to bf16 whole); now a chunk's worth."""
    from collage_train.metrics.live_memory import LiveTensorBytes

    numel, chunk = 1 << 20, 1 << 14
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen) * 0.05)
    optimizer = AdamW([param], lr=1e-3, weight_decay=0.1)
    optimizer.step_chunk_numel = chunk
    optimizer.edq_view_dtype = torch.bfloat16
    optimizer.edq_segments = {param: [("block_0", 0, numel // 2), ("head", numel // 2, numel)]}
    peaks = {}
    for track in (False, True, False, True):
        param.grad = torch.randn(numel, generator=gen) * 1e-2
        optimizer.track_edq = track
        with LiveTensorBytes() as live:
            live.track_training_state([param], optimizer)
            before = live.current
            optimizer.step()
        peaks[track] = live.peak - before
    state_bytes = numel * 16  # fp32 master, grad, m, v
    assert peaks[True] - peaks[False] <= 40 * chunk  # bytes per tracked element, bounded
    assert peaks[True] < 0.02 * state_bytes + peaks[False]


@pytest.mark.parametrize(
    "settings",
    [
        {"moment_dtype": torch.bfloat16},  # the chunked step
        {"master_dtype": torch.float32, "mask": True},  # the chunked step under a step_mask
        {"master_dtype": torch.float32},  # the whole-list step
    ],
    ids=["bf16_moments", "masked_master", "master"],
)
def test_a_transposed_parameter_steps_like_its_contiguous_copy(settings):
    """A non-contiguous parameter (a transposed weight) gets the bits its contiguous copy
    gets, in its weights and in its moments (a chunk taken by ``reshape`` would be a copy
    the step writes into and loses)."""
    settings = dict(settings)
    mask = torch.tensor(True) if settings.pop("mask", False) else None
    dtype = torch.bfloat16 if "master_dtype" in settings else torch.float32
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(40, 30, generator=gen) * 0.05).to(dtype)
    transposed = torch.nn.Parameter(base.t())  # shares base's storage: not contiguous
    contiguous = torch.nn.Parameter(base.t().contiguous())
    assert not transposed.is_contiguous()
    optimizers = [
        AdamW([p], lr=1e-3, weight_decay=0.1, **settings) for p in (transposed, contiguous)
    ]
    for optimizer in optimizers:
        optimizer.step_chunk_numel = 256  # several chunks
    for _ in range(3):
        grad = (torch.randn(30, 40, generator=gen) * 1e-2).to(dtype)
        for param, optimizer in zip((transposed, contiguous), optimizers, strict=True):
            param.grad = grad.clone()
            optimizer.step_mask = mask
            optimizer.step()
    assert torch.equal(transposed.detach(), contiguous.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        ours = optimizers[0].state[transposed][key]
        assert torch.equal(ours, optimizers[1].state[contiguous][key]), key
