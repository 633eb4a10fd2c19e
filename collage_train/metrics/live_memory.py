"""Peak bytes of live tensors on any device, CPU included, measured op by op.

CUDA has an allocator that reports its peak; the CPU has none. ``LiveTensorBytes`` is
a dispatch mode that sees every tensor an operator returns, in forward and backward,
and counts each new storage once until it is freed (a finalizer on the storage object,
which PyTorch keeps for as long as the storage lives, views and autograd's saved
tensors included). ``peak`` is then what ``torch.cuda.max_memory_allocated`` would
report without the allocator's rounding and caching, i.e. the quantity a memory
planner predicts and can be checked against on CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of distinct live storages; ``peak`` is the high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state)."""
        for tensor in tensors:
            if tensor is not None:
                self._add(tensor)

    def track_training_state(
        self, parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer
    ) -> None:
        """Count the parameters and every optimizer state tensor (what lives between steps)."""
        self.track(parameters)
        for state in optimizer.state.values():
            self.track(v for v in state.values() if isinstance(v, torch.Tensor))

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out
