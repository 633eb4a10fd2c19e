"""The peak bytes a piece of code allocates through torch, on the host and on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def allocation_peak(device: torch.device) -> Iterator[dict[str, int]]:
    """Fills the yielded dict, once the block ends, with the most bytes held at once above
    what was held when it started: ``host`` (every CPU allocation torch makes, read from
    the profiler's memory events in time order) and ``device`` (CUDA: the allocator's peak;
    a CPU run's device is the host)."""
    peaks: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peaks
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    ]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    peaks["host"] = peak
    if device.type == "cuda":
        peaks["device"] = torch.cuda.max_memory_allocated(device) - start
    else:
        peaks["device"] = peak
