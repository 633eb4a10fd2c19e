"""A host batch onto the training device without making the host wait for the copy.

``Tensor.to(device, non_blocking=True)`` is asynchronous with respect to the host only
when the source is in page-locked (pinned) memory; from pageable memory the argument has
no effect and the host waits while the driver stages the data (PyTorch docs,
``torch.Tensor.cuda``; tutorial "A guide on good usage of non_blocking and pin_memory()
in PyTorch"). So on CUDA the batch is first copied into pinned memory, a host copy of a
few hundred KB of token ids (8 bytes per token), and the transfer is then queued on the
current stream while the host goes on to launch the forward pass behind it. The pinned
block comes from PyTorch's caching host allocator, which records the transfer on it and
hands the block out again only once that transfer has completed, so the pinned copy
may be dropped as soon as the transfer is queued. On CPU the loader's tensor is used as
it is: nothing is copied.
"""

from __future__ import annotations

import torch


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` on ``device``: pinned and copied without blocking on CUDA, as is on CPU."""
    if device.type != "cuda":
        return batch.to(device)
    if not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)
