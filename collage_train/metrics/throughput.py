"""Throughput accounting: tokens per second and model FLOPs utilisation (MFU).

MFU is measured against the accelerator's dense bf16 tensor peak (no 2:4 sparsity),
looked up from the device name in ``DENSE_BF16_PEAKS``; ``metrics.peak_tflops``
overrides it for a card the table does not know.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeakRow:
    """One card: its dense bf16 peak and the device names that are it."""

    card: str
    pattern: str  # regular expression searched (case-insensitively) in the device name
    tflops: float


# Dense bf16 tensor peaks in TFLOP/s, per GPU, from the vendors' data sheets; where a
# sheet prints only the 2:4-sparse figure, the dense one is half of it. Device names
# (torch.cuda.get_device_name) are matched most specific first, on whole words, so
# that "H20" does not match "H200", "B200" not "GB200", "L4" not "L40S", "A10" not
# "A100". Sources:
#   H100 SXM / PCIe / NVL 989 / 756 / 835: NVIDIA H100 Tensor Core GPU datasheet
#     (1,979 / 1,513 / 1,671 with sparsity); the SXM part reports itself as
#     "NVIDIA H100 80GB HBM3", the others as "NVIDIA H100 PCIe" and "NVIDIA H100 NVL".
#   H800 SXM / PCIe 989 / 756: NVIDIA H800 datasheet (H100 compute, cut interconnect).
#   H200 SXM / NVL 989 / 835: NVIDIA H200 datasheet; GH200 989: NVIDIA GH200 datasheet.
#   H20 148: NVIDIA H20 datasheet (FP16/BF16 148, FP8 296).
#   B200 / B300 2,250: NVIDIA HGX B200 / HGX B300 specifications (36 PFLOPS FP16/BF16
#     with sparsity for 8 GPUs); GB200 / GB300 2,500: NVIDIA GB200 NVL72 / GB300 NVL72
#     specifications (360 PFLOPS with sparsity for 72 GPUs).
#   A100 (SXM and PCIe, 40 and 80 GB) 312: NVIDIA A100 datasheet (624 with sparsity);
#     A800 312: NVIDIA A800 datasheet. A10 125: NVIDIA A10 datasheet.
#   L40S 362 / L40 181 / L4 121: NVIDIA L40S / L40 / L4 datasheets (733 / 362 / 242
#     with sparsity). RTX 4090 165.2 and RTX 6000 Ada 364.2 (FP16/BF16 with FP32
#     accumulate, the rate mixed-precision training gets): NVIDIA Ada Lovelace
#     architecture whitepaper, appendix tables.
#   AMD Instinct (ROCm reports "AMD Instinct MI300X" and the like): MI300X / MI325X
#     1,307.4, MI300A 980.6, MI250X 383.0, MI350X 2,306.9, MI355X 2,516.6: AMD Instinct
#     product specifications (compute units x peak clock x bf16 FLOPs per clock per CU:
#     304 x 2.1 GHz x 2,048 for MI300X and MI325X; 256 x 2.2 / 2.4 GHz x 4,096 for
#     MI350X / MI355X). A bare architecture name ("gfx942": MI300A, MI300X or MI325X)
#     is not enough to pick one and gives None.
DENSE_BF16_PEAKS: tuple[PeakRow, ...] = (
    PeakRow("GB300", r"\bGB300\b", 2500.0),
    PeakRow("GB200", r"\bGB200\b", 2500.0),
    PeakRow("B300", r"\bB300\b", 2250.0),
    PeakRow("B200", r"\bB200\b", 2250.0),
    PeakRow("GH200", r"\bGH200\b", 989.0),
    PeakRow("H200 NVL", r"\bH200\b.*\bNVL\b", 835.0),
    PeakRow("H200 SXM", r"\bH200\b", 989.0),
    PeakRow("H20", r"\bH20\b", 148.0),
    PeakRow("H100 NVL", r"\bH100\b.*\bNVL\b", 835.0),
    PeakRow("H100 PCIe", r"\bH100\b.*\bPCIe\b", 756.0),
    PeakRow("H100 SXM", r"\bH100\b", 989.0),
    PeakRow("H800 PCIe", r"\bH800\b.*\bPCIe\b", 756.0),
    PeakRow("H800 SXM", r"\bH800\b", 989.0),
    PeakRow("A100", r"\bA100\b", 312.0),
    PeakRow("A800", r"\bA800\b", 312.0),
    PeakRow("L40S", r"\bL40S\b", 362.0),
    PeakRow("L40", r"\bL40\b", 181.0),
    PeakRow("L4", r"\bL4\b", 121.0),
    PeakRow("A10", r"\bA10\b", 125.0),
    PeakRow("RTX 4090", r"\bRTX 4090\b", 165.2),
    PeakRow("RTX 6000 Ada", r"\bRTX 6000 Ada\b", 364.2),
    PeakRow("MI355X", r"\bMI355X\b", 2516.6),
    PeakRow("MI350X", r"\bMI350X\b", 2306.9),
    PeakRow("MI325X", r"\bMI325X\b", 1307.4),
    PeakRow("MI300X", r"\bMI300X\b", 1307.4),
    PeakRow("MI300A", r"\bMI300A\b", 980.6),
    PeakRow("MI250X", r"\bMI250X\b", 383.0),
)

_noted: set[str] = set()  # device names already said to be unknown (one line each)


def match_peak(device_name: str) -> PeakRow | None:
    """The table's row for a device name, or None when no row matches it."""
    for row in DENSE_BF16_PEAKS:
        if re.search(row.pattern, device_name, flags=re.IGNORECASE):
            return row
    return None


def detect_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` from the table above, or None (CPU, unknown GPU:
    the latter said once, in one line, with the setting that supplies the peak)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    row = match_peak(name)
    if row is not None:
        return row.tflops
    if name not in _noted:
        _noted.add(name)
        log.warning(
            "no dense bf16 peak known for GPU %r: MFU is not reported; set "
            "metrics.peak_tflops=N (the data sheet's dense bf16 TFLOP/s) to report it",
            name,
        )
    return None


def model_flops_utilisation(
    tokens_per_s: float, flops_per_token: float, peak_tflops: float | None
) -> float | None:
    """Achieved model FLOP/s over the peak, or None when no peak is known."""
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)
