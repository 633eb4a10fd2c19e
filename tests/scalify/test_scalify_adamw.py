"""ScaledAdamW: scaled-fp16 state tracks a float64 AdamW where plain fp16 state cannot."""

from __future__ import annotations

import io
import math

import pytest
import torch
from float64_adamw import (
    BETAS,
    EPS,
    GRAD_MAGNITUDES,
    LR,
    STEPS,
    WD,
    Float64AdamW,
    adamw_grads,
    adamw_params,
)

from collage_train.scalify.adamw import ScaledAdamW, load_scaled, store_scaled
from collage_train.scalify.scale import is_power_of_two


def _run(optimizer: torch.optim.Optimizer, params, steps: int = STEPS, first: int = 0) -> None:
    for step in range(first, first + steps):
        for p, g in zip(params, adamw_grads(step, params), strict=True):
            p.grad = g.to(p.dtype)
        optimizer.step()


def _errors(params, reference: Float64AdamW) -> list[float]:
    """Per parameter, max |p - p_ref| in units of the total movement budget lr * steps."""
    return [
        ((p.detach().double() - ref).abs().max() / (LR * STEPS)).item()
        for p, ref in zip(params, reference.params, strict=True)
    ]


def _reference_after(steps: int = STEPS) -> tuple[list[torch.nn.Parameter], Float64AdamW]:
    params = adamw_params()
    reference = Float64AdamW(params)
    for step in range(steps):
        reference.step(adamw_grads(step, params))
    return params, reference


def test_store_scaled_round_trips_tiny_and_huge_values():
    for magnitude in (1e-12, 1.0, 1e12):
        value = torch.randn(100) * magnitude
        data, scale = store_scaled(value)
        assert data.dtype == torch.float16 and is_power_of_two(scale)
        back = load_scaled(data, scale)
        assert torch.allclose(back, value, rtol=2.0**-11, atol=0)
    plain, one = store_scaled(torch.tensor([1e-9, 1e9]), scaled=False)
    assert one.item() == 1.0 and plain.tolist() == [0.0, 65504.0]


def test_scaled_fp16_state_tracks_a_float64_adamw():
    params, reference = _reference_after()
    optimizer = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    _run(optimizer, params)
    # each step moves a weight by about lr; fp16 state costs ~2**-11 of that per step
    assert max(_errors(params, reference)) < 2e-3
    assert optimizer.rescale_count > 0


def test_plain_fp16_state_fails_where_scaled_state_passes():
    """Unscaled fp16: v underflows for 1e-6 gradients and overflows for 1e4 gradients."""
    params, reference = _reference_after()
    optimizer = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, scaled=False)
    _run(optimizer, params)
    tiny, unit, huge = _errors(params, reference)
    assert unit < 2e-3  # the unit-sized gradients are fine either way
    assert tiny > 0.1 and huge > 0.1
    assert optimizer.rescale_count == 0
    # v ~ 1e8 saturates at the fp16 maximum; v ~ 1e-15 flushes to zero
    saturated = load_scaled(*_moment(optimizer, params[2], "exp_avg_sq"))
    assert (saturated == torch.finfo(torch.float16).max).float().mean() > 0.5
    assert (_moment(optimizer, params[0], "exp_avg_sq")[0] == 0).all()


def _moment(optimizer, param, name):
    state = optimizer.state[param]
    return state[name], state[f"{name}_scale"]


def test_fp16_master_tracks_to_fp16_precision():
    params, reference = _reference_after()
    optimizer = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master="fp16")
    _run(optimizer, params)
    for p, ref in zip(params, reference.params, strict=True):
        state = optimizer.state[p]
        # The fp32 parameter holds the master: fp16 data under a power-of-two scale,
        # exactly; no second copy is stored (12 bytes per parameter, not 14).
        assert "master" not in state
        data = p.detach() / state["master_scale"]
        assert torch.equal(data.half().float(), data)
        # each step rounds the weight to 11 bits relative to its RMS scale
        bound = STEPS * 2.0**-11 * 2 * state["master_scale"].item()
        assert (p.detach().double() - ref).abs().max().item() < bound


def test_fp16_master_of_bf16_parameters_is_stored_beside_them():
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in adamw_params()]
    optimizer = ScaledAdamW(params, lr=LR, master="fp16")
    _run(optimizer, params, steps=3)
    for p in params:
        state = optimizer.state[p]
        assert state["master"].dtype == torch.float16
        master = load_scaled(state["master"], state["master_scale"])
        assert torch.equal(p.detach(), master.bfloat16())
        assert not torch.equal(master, p.detach().float())  # finer than the bf16 weight


@pytest.mark.parametrize("master", ["fp32", "fp16"])
def test_every_stored_scale_is_a_power_of_two(master):
    params = adamw_params()
    optimizer = ScaledAdamW(params, lr=LR, master=master)
    _run(optimizer, params, steps=5)
    for p in params:
        state = optimizer.state[p]
        scales = [v for k, v in state.items() if k.endswith("_scale")]
        assert len(scales) == (3 if master == "fp16" else 2)
        assert all(is_power_of_two(s) for s in scales)
        assert state["exp_avg"].dtype == torch.float16
        assert state["exp_avg_sq"].dtype == torch.float16
        assert 0.5 < state["exp_avg_sq"].float().square().mean().sqrt().item() < 2.5


def test_bf16_params_get_an_fp32_master():
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in adamw_params()]
    optimizer = ScaledAdamW(params, lr=LR)
    _run(optimizer, params, steps=3)
    for p in params:
        master = optimizer.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("master", ["fp32", "fp16"])
def test_state_dict_round_trip_continues_bitwise(master):
    params = adamw_params()
    optimizer = ScaledAdamW(params, lr=LR, weight_decay=WD, master=master)
    _run(optimizer, params, steps=10)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)

    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = ScaledAdamW(copies, lr=LR, weight_decay=WD, master=master)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for p, q in zip(params, copies, strict=True):
        for key, value in optimizer.state[p].items():
            other = restored.state[q][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), key
            if torch.is_tensor(value):
                assert value.dtype == other.dtype

    _run(optimizer, params, steps=10, first=10)
    _run(restored, copies, steps=10, first=10)
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("master", ["fp32", "fp16"])
def test_full_precision_weights_round_trip(master):
    params = adamw_params()
    optimizer = ScaledAdamW(params, lr=LR, master=master)
    _run(optimizer, params, steps=3)
    weights = optimizer.full_precision_weights()
    optimizer.load_full_precision_weights([w * 2 for w in weights])
    doubled = optimizer.full_precision_weights()
    for w, d, p in zip(weights, doubled, params, strict=True):
        assert torch.equal(d, w * 2)
        assert torch.equal(p.detach(), d)


def test_descent_tracking_and_bad_arguments():
    params = adamw_params()
    optimizer = ScaledAdamW(params, lr=LR)
    optimizer.track_edq = True
    _run(optimizer, params, steps=2)
    metrics = optimizer.edq_metrics()
    assert metrics and all(math.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match="master"):
        ScaledAdamW(params, master="bf16")


def _flat_of(params: list[torch.Tensor], pad: int) -> torch.nn.Parameter:
    """The parameters' values flattened into one fp32 tensor, with ``pad`` zeros after."""
    values = [p.detach().reshape(-1) for p in params] + [torch.zeros(pad)]
    return torch.nn.Parameter(torch.cat(values))


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunks-across-pieces"])
@pytest.mark.parametrize("master", ["fp16", "fp32"])
def test_a_flat_tensor_of_pieces_steps_bit_for_bit_as_its_tensors(master, chunk):
    """A ZeRO partition holding whole parameters (and padding) gets each parameter's own
    scales (``flat_pieces``): the same state and weights as the parameters stepped apart,
    also when the step's chunks cut across the pieces."""
    from collage_train.optim.base import FlatPieces

    params = adamw_params()
    apart = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master=master)
    flat = _flat_of(params, pad=5)
    together = ScaledAdamW([flat], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master=master)
    if chunk is not None:
        together.step_chunk_numel = chunk
    lengths = torch.tensor([p.numel() for p in params] + [5])
    together.flat_pieces = {flat: FlatPieces(lengths)}
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = [
            torch.randn(p.shape, generator=generator) * magnitude
            for p, magnitude in zip(params, GRAD_MAGNITUDES, strict=True)
        ]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        flat.grad = _flat_of(grads, pad=5).detach()
        apart.step()
        together.step()
    assert torch.equal(flat.detach(), _flat_of(params, pad=5).detach())
    state = together.state[flat]
    assert torch.equal(state["piece_lengths"], lengths)
    for key in ("exp_avg", "exp_avg_sq"):
        scales = state[f"{key}_scale"]
        assert scales.shape == (len(params) + 1,) and scales[-1] == 1  # padding: zeros
        for index, param in enumerate(params):
            assert torch.equal(scales[index], apart.state[param][f"{key}_scale"])
        data = torch.cat([apart.state[p][key].reshape(-1) for p in params])
        assert torch.equal(state[key][: data.numel()], data)
    # three magnitudes 1e-6 .. 1e4 under one scale would flush the small one's moments
    assert len(set(state["exp_avg_sq_scale"][:-1].tolist())) == len(params)


def _chunk_case(scaled_params: bool, master: str, chunk: int | None):
    from collage_train.scalify.params import accumulate_grad, scale_parameters

    params = adamw_params()
    if scaled_params:
        scale_parameters(torch.nn.ParameterList(params))
    optimizer = ScaledAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master=master)
    if chunk is not None:
        optimizer.step_chunk_numel = chunk
    generator = torch.Generator().manual_seed(4)
    edq = []
    for step in range(4):
        for param, magnitude in zip(params, GRAD_MAGNITUDES, strict=True):
            grad = torch.randn(param.shape, generator=generator) * magnitude
            if scaled_params:
                param.grad = None
                accumulate_grad(param, grad)
            else:
                param.grad = grad
        optimizer.track_edq = step % 2 == 1
        optimizer.step()
        if optimizer.track_edq:
            edq.append(torch.stack([optimizer.last_edq[p] for p in params]))
    return params, optimizer, edq


@pytest.mark.parametrize("scaled_params", [True, False], ids=["8-byte", "fp32-params"])
@pytest.mark.parametrize("master", ["fp16", "fp32"])
def test_the_step_gives_the_same_bits_whatever_the_chunk(scaled_params, master):
    """A chunk of 7 elements cuts every tensor many times: the weights, scales and state
    are those of one chunk per tensor bit for bit (the fresh scales come from float64
    sums gathered chunk by chunk), and EDQ sums to the same partials."""
    whole, one, whole_edq = _chunk_case(scaled_params, master, None)
    chunked, many, chunked_edq = _chunk_case(scaled_params, master, 7)
    assert max(p.numel() for p in whole) > 7 * 10
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a.detach(), b.detach())
        if scaled_params:
            assert torch.equal(a.scalify_scale, b.scalify_scale)
        for key, value in one.state[a].items():
            other = many.state[b][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
    assert one.rescale_count == many.rescale_count > 0
    for x, y in zip(whole_edq, chunked_edq, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-12)


def test_the_steps_temporaries_scale_with_the_chunk_not_the_tensor():
    """One tensor of 2**16 elements stepped 2**10 at a time: the live-tensor peak above the
    state and gradient is tens of bytes per chunk element, not per tensor element."""
    from collage_train.metrics.live_memory import LiveTensorBytes

    param = torch.nn.Parameter(torch.randn(1 << 16))
    optimizer = ScaledAdamW([param], lr=LR, betas=BETAS, master="fp16")
    optimizer.step_chunk_numel = 1 << 10
    param.grad = torch.randn(1 << 16)
    optimizer.step()  # creates the state
    with LiveTensorBytes() as live:
        live.track_training_state([param], optimizer)
        live.track([param.grad])
        before = live.current
        optimizer.track_edq = True
        optimizer.step()
    assert live.peak - before < 40 * (1 << 10) + 4096  # a whole-tensor step: 26 * 2**16


def test_piece_chunks_slice_scales_and_sum_squares_across_chunk_edges():
    """``PieceChunks`` on a flat tensor of pieces 5, 0, 9, 2 read in chunks of 4: each
    chunk's per-element scale is that range of the whole expansion, the squares summed
    chunk by chunk are each piece's, and with ``whole`` adding the other rank's half of a
    cut tensor the scale is that tensor's."""
    from collage_train.optim.base import FlatPieces
    from collage_train.scalify.pieces import PieceChunks
    from collage_train.scalify.scale import per_element, rms_scale

    lengths = torch.tensor([5, 0, 9, 2])
    values = torch.randn(16, dtype=torch.float64) * torch.tensor(
        [1e-3] * 5 + [10.0] * 9 + [1.0] * 2
    )
    other_half = torch.randn(9) * 100.0  # piece 2 is half of a tensor; the rest is elsewhere

    def whole(sums, counts):
        sums, counts = sums.clone(), counts.clone()
        sums[2] += other_half.double().square().sum()
        counts[2] += 9
        return sums, counts

    layout = PieceChunks(16, FlatPieces(lengths, whole), torch.device("cpu"))
    scale = torch.tensor([2.0, 4.0, 8.0, 16.0])
    sums = layout.zero_sums()
    for lo in range(0, 16, 4):
        hi = min(lo + 4, 16)
        assert torch.equal(layout.scale_of(scale, lo, hi), per_element(scale, lengths)[lo:hi])
        layout.add_squares(sums, values[lo:hi], lo, hi)
    pieces = torch.split(values, lengths.tolist())
    assert torch.allclose(sums, torch.stack([p.square().sum() for p in pieces]), rtol=1e-12)
    scales = layout.scales(sums)
    assert scales[0] == rms_scale(pieces[0]) and scales[3] == rms_scale(pieces[3])
    assert scales[1] == 1  # an empty piece
    assert scales[2] == rms_scale(torch.cat([pieces[2].float(), other_half]))
    assert scales[2] != rms_scale(pieces[2])


@pytest.mark.parametrize("scaled", [True, False])
def test_rms_outside_frac_counts_the_pieces_of_a_partition_as_tensors(scaled):
    """Unscaled state (scale pinned at 1) of gradients 1e-6 .. 1e4 leaves its unit range,
    scaled state never does; a flat partition of the same tensors counts each piece as the
    tensor it is, so the fraction is the same as for the tensors apart."""
    from collage_train.optim.base import FlatPieces

    params = adamw_params()
    kwargs = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master="fp16", scaled=scaled)
    apart = ScaledAdamW(params, **kwargs)
    flat = _flat_of(params, pad=0)
    together = ScaledAdamW([flat], **kwargs)
    together.flat_pieces = {flat: FlatPieces(torch.tensor([p.numel() for p in params]))}
    together.step_chunk_numel = 5
    generator = torch.Generator().manual_seed(9)
    grads = [
        torch.randn(p.shape, generator=generator) * magnitude
        for p, magnitude in zip(params, GRAD_MAGNITUDES, strict=True)
    ]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    flat.grad = _flat_of(grads, pad=0).detach()
    apart.step()
    together.step()
    frac = apart.scale_metrics()["scalify_rms_outside_frac"]
    assert together.scale_metrics()["scalify_rms_outside_frac"] == frac
    assert (frac == 0.0) if scaled else (0.0 < frac < 1.0)
