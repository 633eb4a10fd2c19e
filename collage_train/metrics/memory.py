"""Memory accounting: device peaks and the measured size of the model state."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (None when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


def process_memory() -> int | None:
    """This process's share of host memory now (its proportional set size: private pages,
    and shared ones divided among the processes mapping them; None when unknown)."""
    return _proc_bytes("/proc/self/smaps_rollup", "Pss:")


def _proc_bytes(path: str, field: str) -> int | None:
    """The bytes of ``field`` (a line ``FIELD  N kB``) in the /proc file ``path``."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window on CUDA (the host RSS peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory so far: CUDA allocated and reserved on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device),
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mem_bytes": rss if sys.platform == "darwin" else rss * 1024}


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors_in(value)


# A parameter or gradient held as Scalify's scaled data carries its 0-d power-of-two
# scale as this attribute (= collage_train.scalify.scale.SCALE_ATTR; tested).
SCALE_ATTR = "scalify_scale"


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by parameters, their gradients and every optimizer-state tensor.

    Each storage is counted once (tied weights, views), and so is the scale a scaled
    parameter or gradient carries beside its data (``SCALE_ATTR``). Call it after an
    optimizer step and before gradients are released, so that all three are present.
    """
    tensors = list(model.parameters())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [getattr(t, SCALE_ATTR) for t in tensors if hasattr(t, SCALE_ATTR)]
    tensors += list(_tensors_in(list(optimizer.state.values())))
    return storage_bytes(tensors)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storage once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
