"""The dense bf16 peak used for MFU, picked from the name the device reports.

The names are those ``torch.cuda.get_device_name`` gives (nvidia-smi's, and ROCm's
marketing names on AMD); the device name is patched, so these run on any machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from collage_train.metrics import throughput
from collage_train.metrics.throughput import DENSE_BF16_PEAKS, detect_peak_tflops, match_peak

CUDA = torch.device("cuda", 0)

NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0),
    ("NVIDIA H100 SXM5 64GB", "H100 SXM", 989.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0),
    ("NVIDIA H800", "H800 SXM", 989.0),
    ("NVIDIA H800 80GB HBM3", "H800 SXM", 989.0),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756.0),
    ("NVIDIA H200", "H200 SXM", 989.0),
    ("NVIDIA H200 NVL", "H200 NVL", 835.0),
    ("NVIDIA H20", "H20", 148.0),
    ("NVIDIA GH200 480GB", "GH200", 989.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA B300 SXM6 AC", "B300", 2250.0),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("NVIDIA GB300", "GB300", 2500.0),
    ("NVIDIA A100-SXM4-40GB", "A100", 312.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA A800-SXM4-80GB", "A800", 312.0),
    ("NVIDIA A800 80GB PCIe", "A800", 312.0),
    ("NVIDIA L40S", "L40S", 362.0),
    ("NVIDIA L40", "L40", 181.0),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 364.2),
    ("AMD Instinct MI300X", "MI300X", 1307.4),
    ("AMD Instinct MI300X VF", "MI300X", 1307.4),
    ("AMD Instinct MI325X", "MI325X", 1307.4),
    ("AMD Instinct MI300A", "MI300A", 980.6),
    ("AMD Instinct MI250X", "MI250X", 383.0),
    ("AMD Instinct MI355X", "MI355X", 2516.6),
]


@pytest.fixture
def device_named(monkeypatch):
    """Makes ``torch.cuda.get_device_name`` report a given name (no GPU needed)."""

    def _name(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(throughput, "_noted", set())

    return _name


@pytest.mark.parametrize(("name", "card", "tflops"), NAMES)
def test_each_card_gets_its_own_dense_bf16_peak(device_named, name, card, tflops):
    device_named(name)
    assert detect_peak_tflops(CUDA) == tflops
    assert match_peak(name).card == card


@pytest.mark.parametrize(
    "name",
    ["NVIDIA GeForce RTX 3060", "gfx942", "NVIDIA A10G", "NVIDIA RTX A6000", "Some Future GPU"],
)
def test_an_unknown_card_gives_none_and_one_line_naming_the_setting(device_named, caplog, name):
    device_named(name)
    with caplog.at_level(logging.WARNING, logger=throughput.__name__):
        assert detect_peak_tflops(CUDA) is None
        assert detect_peak_tflops(CUDA) is None  # said once per name
    (record,) = caplog.records
    message = record.getMessage()
    assert name in message and "metrics.peak_tflops=" in message and "\n" not in message


def test_the_cpu_has_no_table_peak(device_named):
    device_named("NVIDIA H100 80GB HBM3")  # never asked: a CPU device is not looked up
    assert detect_peak_tflops(torch.device("cpu")) is None


def test_no_row_hides_a_later_one():
    """Each row's own card name picks that row: a shorter name placed before a longer
    one (H20 before H200, L4 before L40S) would take its devices."""
    for row in DENSE_BF16_PEAKS:
        assert match_peak(f"NVIDIA {row.card}") is row, row.card
        assert match_peak(f"AMD Instinct {row.card}") is row, row.card
