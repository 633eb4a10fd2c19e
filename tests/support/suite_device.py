"""The device the suite's training runs use: ``pytest --device cpu|cuda`` (default cpu).

``tests/conftest.py`` reads the option (or, without it, the ``COLLAGE_TEST_DEVICE``
variable) and exports it as ``COLLAGE_TEST_DEVICE`` before any test module is imported,
so that this module, the runs composed in-process (``tiny_config.compose_tiny``), the
real CLI in a subprocess (``cli_runner.tiny_overrides``) and the ranks of a launch all
see the same device:

- cpu: runs say ``train.device=cpu``; launched ranks see no GPU (``CUDA_VISIBLE_DEVICES``
  empty) and use DeepSpeed's CPU accelerator over gloo, as on a machine without a GPU.
- cuda: runs say ``train.device=cuda``; launched ranks use NCCL with one GPU each (their
  ``LOCAL_RANK``), so a launch of N ranks needs N GPUs and is skipped, with that reason,
  on fewer; a one-process ZeRO rank uses GPU 0 over NCCL.

Tests whose subject exists only on the CPU are marked ``@pytest.mark.cpu_only(reason)``
and skipped under ``--device cuda`` with that reason (conftest.py).

Lives in its own uniquely named module (not ``conftest``), like ``tiny_config``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: pytest's controller process loads this module with
# conftest and needs no torch (about 1 s before the workers can start)

VARIABLE = "COLLAGE_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def check_device_option(device: str) -> None:
    """``--device cuda`` where torch sees no GPU is a usage error (pytest: one line, exit
    status 4): nothing would test the GPU."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            "--device cuda but torch sees no CUDA device; run on a GPU machine or without --device"
        )


def suite_device() -> str:
    """``cpu`` or ``cuda``: the device the suite's training runs are told to use."""
    value = os.environ.get(VARIABLE, "cpu") or "cpu"
    if value not in DEVICES:
        raise ValueError(f"{VARIABLE}={value!r}: expected one of {', '.join(DEVICES)}")
    return value


def on_cuda() -> bool:
    return suite_device() == "cuda"


def torch_device() -> torch.device:
    """The suite's device as a ``torch.device`` (GPU 0 under cuda)."""
    import torch

    return torch.device("cuda", 0) if on_cuda() else torch.device("cpu")


def device_overrides() -> list[str]:
    """The overrides that put a composed or launched run on the suite's device; on CUDA
    also ``train.deterministic=true``, where the suite's bitwise comparisons (resume,
    engines against one process) hold (docs/reproducibility.md)."""
    if on_cuda():
        return ["train.device=cuda", "train.deterministic=true"]
    return [f"train.device={suite_device()}"]


def launch_environment() -> dict[str, str]:
    """Variables the ranks of a launch get on top of the parent's (``cli_runner._launch``)."""
    if on_cuda():
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # before any rank's first cuBLAS call
    return {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def launch_drops() -> tuple[str, ...]:
    """Variables removed from the parent's environment for a launch: under cuda, a
    ``DS_ACCELERATOR=cpu`` left by an in-process CPU run must not reach the ranks."""
    return ("DS_ACCELERATOR",) if on_cuda() else ()


def skip_without_gpus(ranks: int) -> None:
    """Under cuda, skip the calling test unless there is one GPU for each of ``ranks``."""
    if not on_cuda():
        return
    import torch

    count = torch.cuda.device_count()
    if count < ranks:
        pytest.skip(
            f"--device cuda: {ranks} NCCL ranks need {ranks} GPUs (one per rank), "
            f"this machine has {count}"
        )
