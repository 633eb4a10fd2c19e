"""A step under ``TrackingOptimizer.step_mask`` (the step guard's verdict on the device).

A False mask leaves weights and every state tensor bit for bit as they were, even with
NaN gradients, and makes the EDQ partials zero; a True mask gives the bits of an unmasked
step; ``rewind_steps`` takes back the step count a refused masked step advanced, after
which the optimizer goes on as if the step had never run. For CollageAdamW, in the eager
step, the C kernel and (tests/optim/triton_interpreted.py) the Triton kernel; for AdamW in its
fp32, mixed_fp32 and bf16_moments forms; for the SR, Kahan and 8-bit rivals (Collage-8bit's
Triton kernel: tests/optim/triton_interpreted_8bit.py), split_fp32's and Scalify's (their scales
kept). An optimizer that cannot mask refuses one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from collage_train.optim import (
    AdamW,
    BlockwiseAdamW,
    Collage8bitAdamW,
    CollageAdamW,
    KahanAdamW,
    SplitMasterAdamW,
    StochasticRoundingAdamW,
)
from collage_train.optim.base import TrackingOptimizer, commit_
from collage_train.optim.collage import cpu_kernel
from collage_train.optim.collage.step_math import collage_tensor_step, step_scalars
from collage_train.scalify.adamw import ScaledAdamW

OK, REFUSED = torch.tensor(True), torch.tensor(False)  # moved to the suite's device in use


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8).clone()


def _snapshot(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list:
    """Every weight and state tensor's bytes, and each parameter's integer step count."""
    tensors = [_bits(p) for p in params]
    for param in params:
        for key, value in sorted(optimizer.state[param].items()):
            tensors.append(_bits(value) if torch.is_tensor(value) else (key, value))
    return tensors


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b, strict=True)
    )


def _params(
    dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu"
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (70_001,), (5,)]
    return [
        torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(device, dtype)) for s in shapes
    ]


def _grads(params: list[torch.Tensor], step: int, nan: bool = False) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for param in params:
        grad = torch.randn(param.shape, generator=gen) * 1e-2
        if nan:
            grad.view(-1)[::97] = float("nan")
        param.grad = grad.to(param.device, param.dtype)


OPTIMIZERS = {
    "collage_plus_eager": (torch.bfloat16, lambda p: CollageAdamW(p, mode="plus", kernel="eager")),
    "collage_light_c": (torch.bfloat16, lambda p: CollageAdamW(p, mode="light", kernel="compiled")),
    "collage_none_c": (torch.bfloat16, lambda p: CollageAdamW(p, mode="none", kernel="compiled")),
    "fp32": (torch.float32, lambda p: AdamW(p)),
    "mixed_fp32": (torch.bfloat16, lambda p: AdamW(p, master_dtype=torch.float32)),
    "bf16_moments": (torch.float32, lambda p: AdamW(p, moment_dtype=torch.bfloat16)),
    "bf16_sr": (torch.bfloat16, lambda p: StochasticRoundingAdamW(p, seed=3)),
    "bf16_kahan": (torch.bfloat16, lambda p: KahanAdamW(p)),
    "adamw_8bit": (torch.bfloat16, lambda p: BlockwiseAdamW(p, master_dtype=torch.float32)),
    "adamw_8bit_fp32": (torch.float32, lambda p: BlockwiseAdamW(p)),
    "collage_8bit_eager": (torch.bfloat16, lambda p: Collage8bitAdamW(p, kernel="eager")),
    "collage_8bit_c": (torch.bfloat16, lambda p: Collage8bitAdamW(p, kernel="compiled")),
    "split_fp32": (torch.bfloat16, lambda p: SplitMasterAdamW(p)),
    "scalify_fp16_master": (torch.float32, lambda p: ScaledAdamW(p, master="fp16")),
    "scalify_fp32_state": (torch.bfloat16, lambda p: ScaledAdamW(p, state="fp32")),
}


def _build(name: str, device: torch.device, seed: int = 0):
    """The optimizer ``name`` over three parameters on ``device``; the ``_c`` ones run their
    fused kernel: the C kernel on CPU, the Triton kernel on CUDA."""
    if name.endswith("_c") and device.type == "cpu" and cpu_kernel.c_compiler() is None:
        pytest.skip("the C kernel needs a C compiler")
    dtype, make = OPTIMIZERS[name]
    params = _params(dtype, seed, device)
    optimizer = make([{"params": params, "weight_decay": 0.1, "lr": 1e-3}])
    optimizer.step_chunk_numel = 1 << 14  # several chunks in the large tensor
    return params, optimizer


def _step(optimizer, mask=None, track=False) -> None:
    device = optimizer.param_groups[0]["params"][0].device
    optimizer.step_mask = mask.to(device) if mask is not None else None
    optimizer.track_edq = track
    try:
        optimizer.step()
    finally:
        optimizer.step_mask = None
        optimizer.track_edq = False


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_refused_step_changes_nothing_and_rewinds_to_an_unstepped_run(name, device):
    params, optimizer = _build(name, device)
    ref_params, reference = _build(name, device)
    for t in range(1, 3):
        for p in (params, ref_params):
            _grads(p, t)
        _step(optimizer)
        _step(reference)
    before = _snapshot(optimizer, params)
    _grads(params, 99, nan=True)
    _step(optimizer, REFUSED, track=True)
    partials = torch.stack([row.reshape(-1, 6).sum(0) for row in optimizer.last_edq.values()])
    assert torch.equal(partials, torch.zeros_like(partials))
    after = _snapshot(optimizer, params)
    steps = [optimizer.state[p]["step"] for p in params]
    assert steps == [3, 3, 3]  # the count advanced: the host learns of the refusal later
    optimizer.rewind_steps(1)
    assert _same(_snapshot(optimizer, params), before)
    assert not _same(after, before)  # only in the step counts
    # then both go on alike, masked-applied against unmasked: bit for bit
    for t in range(3, 5):
        for p in (params, ref_params):
            _grads(p, t)
        _step(optimizer, OK)
        _step(reference)
    assert _same(_snapshot(optimizer, params), _snapshot(reference, ref_params))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_refused_step_has_zero_descent_also_per_segment(name, device):
    """Under ``edq_segments`` (a ZeRO partition's layer-group ranges) the step sums each
    range itself, from the weights and low parts after the step: a refused step's rows,
    the low part's terms included, are zero as they are without segments."""
    params, optimizer = _build(name, device)
    optimizer.edq_segments = {
        p: [("first", 0, p.numel() // 2), ("rest", p.numel() // 2, p.numel())] for p in params
    }
    for t in range(1, 3):
        _grads(params, t)
        _step(optimizer, track=True)
    assert any(row.abs().sum() > 0 for row in optimizer.last_edq.values())  # tracked
    _grads(params, 99, nan=True)
    _step(optimizer, REFUSED, track=True)
    for row in optimizer.last_edq.values():
        assert torch.equal(row, torch.zeros_like(row))


@pytest.mark.parametrize("name", ["collage_plus_eager", "mixed_fp32"])
def test_an_applied_masked_step_tracks_the_same_descent(name, device):
    params, optimizer = _build(name, device)
    ref_params, reference = _build(name, device)
    for p in (params, ref_params):
        _grads(p, 1)
    _step(optimizer, OK, track=True)
    _step(reference, None, track=True)
    for param, ref in zip(params, ref_params, strict=True):
        assert torch.equal(optimizer.last_edq[param], reference.last_edq[ref])


@pytest.mark.cpu_only(
    "the C kernel steps CPU tensors (Triton's: tests/optim/triton_interpreted.py)"
)
@pytest.mark.parametrize("mode", ["none", "light", "plus"])
def test_the_c_kernel_and_the_eager_step_mask_alike(mode):
    """Bitwise: the kernel reads the mask itself (no host read), the eager step writes
    with ``torch.where``; a refused step's returned update and partials are zero."""
    if cpu_kernel.c_compiler() is None:
        pytest.skip("the C kernel needs a C compiler")
    gen = torch.Generator().manual_seed(3)
    n = 3 * 2**16 + 5
    base = [(torch.randn(n, generator=gen) * 0.05).bfloat16()] + [
        (torch.rand(n, generator=gen) * 1e-3).bfloat16() for _ in range(4)
    ]
    runs = [copy.deepcopy(base) for _ in range(2)]
    steps = (
        lambda *a, **k: collage_tensor_step(*a, mode=mode, **k),
        cpu_kernel.cpu_tensor_step(mode),
    )
    for t, mask in enumerate((REFUSED, OK, REFUSED), start=1):
        grad = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
        if mask is REFUSED:
            grad[::101] = float("nan")
        scalars = step_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, t)
        outs = []
        for (theta, dtheta, m, v, dv), step in zip(runs, steps, strict=True):
            kept = [x.clone() for x in (theta, dtheta, m, v, dv)]
            dtheta = dtheta if mode != "none" else None
            dv = dv if mode == "plus" else None
            for return_update in (True, False):
                if return_update and mask is OK:
                    continue  # an applied step runs once
                outs.append(
                    step(theta, dtheta, m, v, dv, grad, scalars, track=True,
                         return_update=return_update, mask=mask)
                )  # fmt: skip
            if mask is REFUSED:
                pairs = zip((theta, dtheta, m, v, dv), kept, strict=True)
                assert all(torch.equal(_bits(a), _bits(b)) for a, b in pairs if a is not None)
                assert all(torch.equal(o, torch.zeros_like(o)) for o in outs[-2:])
        for a, b in zip(*runs, strict=True):
            assert torch.equal(_bits(a), _bits(b)), f"mode {mode}, step {t}"


def test_commit_keeps_the_old_bits_under_a_false_mask():
    target = torch.tensor([-0.0, 1.0, float("inf")])
    commit_(target, torch.tensor([float("nan"), 2.0, 3.0]), REFUSED)
    assert torch.equal(_bits(target), _bits(torch.tensor([-0.0, 1.0, float("inf")])))
    commit_(target, torch.tensor([0.0, 2.0, 3.0]), OK)
    assert target.tolist() == [0.0, 2.0, 3.0]


def test_an_optimizer_that_cannot_mask_refuses_a_mask():
    """One written elsewhere against TrackingOptimizer, without ``masks_on_device``: the
    trainer reads the guard's verdict on the host for it instead."""

    class PlainSGD(TrackingOptimizer):
        def _step_group(self, group, params):
            for param in params:
                param.detach().add_(param.grad, alpha=-group["lr"])

    params = _params(torch.float32)
    optimizer = PlainSGD(params, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    _grads(params, 1)
    optimizer.step_mask = REFUSED
    with pytest.raises(TypeError, match="cannot mask"):
        optimizer.step()
