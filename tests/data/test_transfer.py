"""Batches onto the device: pinned and non-blocking on CUDA, untouched on CPU."""

from __future__ import annotations

import pytest
import torch

from collage_train.data.transfer import to_device


def _spy_on_pinning(monkeypatch) -> list[torch.Tensor]:
    pinned: list[torch.Tensor] = []
    real = torch.Tensor.pin_memory

    def pin_memory(tensor, *args, **kwargs):
        pinned.append(tensor)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return pinned


def test_a_cpu_run_trains_on_the_loaders_tensor_itself(monkeypatch):
    pinned = _spy_on_pinning(monkeypatch)
    batch = torch.arange(2 * 9).reshape(2, 9)
    assert to_device(batch, torch.device("cpu")) is batch  # no copy, no pinning
    assert pinned == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned transfers need a CUDA device")
def test_a_cuda_batch_is_pinned_once_and_arrives_intact(monkeypatch):
    pinned = _spy_on_pinning(monkeypatch)
    device = torch.device("cuda")
    batch = torch.randint(0, 50_000, (8, 2049))
    moved = to_device(batch, device)
    assert moved.device.type == "cuda" and len(pinned) == 1
    already = batch.pin_memory()
    pinned.clear()
    assert torch.equal(to_device(already, device).cpu(), batch)  # synchronises
    assert pinned == []  # a pinned batch is not copied again
    assert torch.equal(moved.cpu(), batch)
