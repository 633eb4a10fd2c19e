"""The outer step's pure functions: reductions to DiLoCo and to the plain inner optimizer,
deterministic rank-order averaging, Nesterov momentum, error feedback and checksums."""

from __future__ import annotations

import pytest
import torch
from strategy_steps import build, take_steps

from collage_train.comm import codec
from collage_train.comm.codec import CodecSettings
from collage_train.comm.outer import (
    OuterSettings,
    OuterState,
    apply_payloads_,
    checksum,
    decode_payload,
    make_payload,
    mean_in_rank_order,
    outer_sgd_,
    payload_nbytes,
    pseudo_gradients,
)

SHAPES = [(40, 30), (0,), (7,), (300,)]
LOSSLESS = CodecSettings(chunk=256, k=256, bits=32)


def bits(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.reshape(-1).view(torch.int32).tolist() for t in tensors]


def local_weights(shared, rank: int, step: int) -> list[torch.Tensor]:
    """What replica ``rank`` might hold after its inner steps: the shared weights, moved."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [s + 1e-2 * torch.randn(s.shape, generator=gen) for s in shared]


def run_replicas(settings: OuterSettings, replicas: int, outer_steps: int) -> list[OuterState]:
    """Pure-function simulation: every replica starts from the same weights."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=gen) for shape in SHAPES]
    states = [OuterState.start(settings, start) for _ in range(replicas)]
    history = []
    for step in range(outer_steps):
        payloads = [
            make_payload(settings, state, local_weights(state.shared, rank, step))
            for rank, state in enumerate(states)
        ]
        numels = [s.numel() for s in start]
        assert all(p.numel() == payload_nbytes(settings, numels) for p in payloads)
        for state in states:
            apply_payloads_(settings, state, payloads)
        assert all(bits(s.shared) == bits(states[0].shared) for s in states)  # replicas agree
        history.append([t.clone() for t in states[0].shared])
    return states, history


@pytest.mark.parametrize("beta", [0.0, 0.95])
def test_full_density_unquantized_sparseloco_equals_diloco_with_plain_sgd(beta):
    """k = chunk and raw fp32 values: nothing is left behind, so the error feedback stays
    zero (any beta) and the outer step is DiLoCo's with momentum 0, bit for bit."""
    dense = OuterSettings("diloco", lr=0.7, momentum=0.0)
    sparse = OuterSettings("sparseloco", lr=0.7, error_feedback=beta, codec=LOSSLESS)
    dense_states, dense_history = run_replicas(dense, replicas=2, outer_steps=4)
    sparse_states, sparse_history = run_replicas(sparse, replicas=2, outer_steps=4)
    for a, b in zip(dense_history, sparse_history, strict=True):
        assert bits(a) == bits(b)
    for state in sparse_states:
        assert all(not bool(e.any()) for e in state.errors)
    assert dense_states[0].errors == [] and dense_states[0].momentum == []


def test_sparse_payload_is_smaller_and_loses_what_error_feedback_keeps():
    settings = OuterSettings("sparseloco", lr=1.0, error_feedback=0.9, codec=CodecSettings())
    gen = torch.Generator().manual_seed(3)
    shared = [torch.randn(64, 4096, generator=gen)]
    state = OuterState.start(settings, shared)
    state.errors = [torch.randn(64, 4096, generator=gen) * 1e-3]
    errors_before = [e.clone() for e in state.errors]
    local = local_weights(shared, 0, 0)
    payload = make_payload(settings, state, local)
    assert payload.numel() * 100 < 4 * shared[0].numel()  # 146x smaller than fp32
    (sent,) = decode_payload(settings, payload, [shared[0].shape])
    (delta,) = pseudo_gradients(shared, local)
    acc = torch.add(delta, errors_before[0], alpha=0.9)
    assert torch.equal(state.errors[0], acc - sent)  # what was not sent is kept
    assert int((sent != 0).sum()) == 64 * 64  # 64 of every 4096-element chunk
    apply_payloads_(settings, state, [payload])
    assert torch.equal(state.shared[0], shared[0] - sent)  # lr 1, one replica


def test_mean_sums_in_rank_order_then_divides():
    """The order is part of the result in floating point; it is always rank 0, 1, 2, ..."""
    ranks = [[torch.tensor([1e8])], [torch.tensor([1.0])], [torch.tensor([-1e8])]]
    (mean,) = mean_in_rank_order(iter(ranks))
    assert mean.item() == ((torch.tensor(1e8) + 1.0) - 1e8).item() / 3 == 0.0
    (reordered,) = mean_in_rank_order([ranks[0], ranks[2], ranks[1]])
    assert reordered.item() == pytest.approx(1 / 3)  # another order, another answer
    with pytest.raises(ValueError, match="at least one"):
        mean_in_rank_order([])


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_momentum_matches_torch_sgd(nesterov):
    settings = OuterSettings("diloco", lr=0.7, momentum=0.9, nesterov=nesterov)
    gen = torch.Generator().manual_seed(4)
    start = [torch.randn(shape, generator=gen) for shape in SHAPES]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=nesterov)
    state = OuterState.start(settings, start)
    for _ in range(5):
        update = [torch.randn(shape, generator=gen) for shape in SHAPES]
        for param, grad in zip(reference, update, strict=True):
            param.grad = grad.clone()
        sgd.step()
        outer_sgd_(settings, state, update)
        for mine, theirs in zip(state.shared, reference, strict=True):
            assert torch.equal(mine, theirs.detach())


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
@pytest.mark.parametrize(
    "name", ["fp32", "mixed_fp32", "split_fp32", "bf16", "collage_light", "collage_plus"]
)
def test_one_replica_syncing_every_step_equals_the_inner_optimizer(name, method):
    """R = 1, H = 1, outer lr 1 without momentum (SparseLoCo lossless, beta 0): every outer
    step hands the inner optimizer's own result back to it, bit for bit.

    ``x - (x - x_1)`` is ``x_1`` exactly whenever ``x - x_1`` is exact in fp32, which holds
    for an inner step smaller than the weight (Sterbenz); only a weight that falls
    below 2^-24 of its value in one outer step could come back rounded. For Collage the
    pair (theta, dtheta) must also fit an fp32, as it does for these weights (see
    test_replicas.py for a run where a few dtheta do not).
    """
    settings = OuterSettings(method, lr=1.0, error_feedback=0.0, codec=LOSSLESS)
    plain_params, plain = build(name)
    params, optimizer = build(name)
    state = OuterState.start(settings, optimizer.full_precision_weights())
    for step in range(6):
        take_steps(plain_params, plain, steps=1, seed=step)
        take_steps(params, optimizer, steps=1, seed=step)
        payload = make_payload(settings, state, optimizer.full_precision_weights())
        apply_payloads_(settings, state, [payload])
        optimizer.load_full_precision_weights(state.shared)
    for a, b in zip(plain_params, params, strict=True):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
    assert bits(plain.full_precision_weights()) == bits(optimizer.full_precision_weights())


def test_checksum_sees_a_one_ulp_difference():
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(shape, generator=gen) for shape in SHAPES]
    same = [t.clone() for t in tensors]
    assert torch.equal(checksum(tensors), checksum(same))
    same[0].view(-1)[17] = torch.nextafter(same[0].view(-1)[17], torch.tensor(float("inf")))
    assert not torch.equal(checksum(tensors), checksum(same))
    assert checksum([]).tolist() == [0.0, 0.0]
    assert checksum(tensors).dtype == torch.float64


def test_state_round_trips_and_rejects_another_model():
    settings = OuterSettings("sparseloco", lr=1.0, momentum=0.5, codec=CodecSettings(chunk=64, k=4))
    state = OuterState.start(settings, [torch.ones(3, 4), torch.ones(5)])
    assert state.nbytes() == 3 * 17 * 4  # shared, errors and momentum, fp32
    state.errors[0] += 2.0
    copy = OuterState.start(settings, [torch.zeros(3, 4), torch.zeros(5)])
    copy.load_state_dict(state.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(copy.errors, state.errors, strict=True))
    other = OuterState.start(settings, [torch.zeros(4, 3), torch.zeros(5)])
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(state.state_dict())


def test_payload_sizes():
    numels = [4096 * 10, 100]
    assert payload_nbytes(OuterSettings("diloco"), numels) == 4 * sum(numels)
    sparse = OuterSettings("sparseloco", codec=CodecSettings())
    assert payload_nbytes(sparse, numels) == codec.payload_nbytes(numels, CodecSettings())
    with pytest.raises(ValueError, match="diloco, sparseloco"):
        OuterSettings("ddp")
