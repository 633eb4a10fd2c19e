"""Throughput accounting: tokens per second and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

# Dense (non-sparse) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets.
# Matched as substrings of torch.cuda.get_device_name(), most specific first.
DENSE_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def detect_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` from the table above, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in DENSE_BF16_PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def model_flops_utilisation(
    tokens_per_s: float, flops_per_token: float, peak_tflops: float | None
) -> float | None:
    """Achieved model FLOP/s over the peak, or None when no peak is known."""
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)
