"""LiveTensorBytes: peak bytes of live tensors, forward and backward, on the CPU."""

from __future__ import annotations

import torch

from collage_train.metrics.live_memory import LiveTensorBytes


def test_counts_new_storages_once_and_releases_them():
    with LiveTensorBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20]  # same storage: not counted again
        b = a * 2  # 4000 more
        assert live.current == 8000
        del a  # the view keeps the storage alive
        assert live.current == 8000
        del view, b
        assert live.current == 0
    assert live.peak == 8000


def test_backward_saved_tensors_and_gradients_are_counted():
    layer = torch.nn.Linear(64, 256, bias=False)  # 64 KiB of weight
    x = torch.randn(32, 64)
    with LiveTensorBytes() as live:
        live.track(layer.parameters())
        weight_bytes = live.current
        hidden = torch.relu(layer(x))  # relu's output is saved for backward
        loss = hidden.sum()
        del hidden
        saved = live.current - weight_bytes
        loss.backward()
    assert weight_bytes == 64 * 256 * 4
    assert saved >= 32 * 256 * 4  # the saved activation outlives the Python name
    assert layer.weight.grad is not None
    assert live.current >= weight_bytes + weight_bytes  # the gradient is live at the end
    assert live.peak >= live.current
