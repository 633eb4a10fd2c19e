"""A host copy of a checkpoint's state, so that it can be written while training goes on.

``HostStaging.stage`` copies every tensor of a state (nested dicts, lists and tuples, as
``torch.save`` takes them) into host buffers that are kept and reused by the next save:
pinned memory on CUDA, so that the copies are asynchronous device-to-host transfers
queued on the current stream, in order before any later kernel that could change the
tensors. ``StagedState.ready`` waits for those copies (the writer's thread calls it);
the training loop never does. On CPU the copy is an ordinary memory copy.

Tensors that are the same view of the same storage (a tied embedding, a state dict entry
repeated) are copied once and stay one tensor in the written file. A view of a larger
storage (DeepSpeed's flat ZeRO buffers) is copied alone, so the file holds only its
elements. Objects that are neither tensors nor containers (DeepSpeed's config records)
are deep-copied: the background write never reads anything training can change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

_PLAIN = (str, bytes, int, float, bool, type(None))
# One host buffer: (file name, position in the file's state), shape, dtype.
BufferSpec = tuple[tuple[str, int], torch.Size, torch.dtype]


@dataclass
class StagedState:
    """Host copies of the files of one checkpoint: relative file name -> object."""

    files: dict[str, Any]
    nbytes: int
    _event: torch.cuda.Event | None = field(default=None, repr=False)

    def ready(self) -> None:
        """Wait until the device-to-host copies have landed (CUDA); at once on CPU."""
        if self._event is not None:
            self._event.synchronize()


class HostStaging:
    """Reusable host buffers for the state of successive checkpoints of one run.

    Buffers are matched to tensors by file and position in the state, so that a run whose
    state keeps its shapes (every training run) allocates them once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes held for the copies."""
        return sum(buf.numel() * buf.element_size() for buf in self._buffers.values())

    def stage(self, files: dict[str, Any]) -> StagedState:
        """Copy ``files`` (relative file name -> state) into host buffers; return them."""
        staged: dict[str, Any] = {}
        total = 0
        for name, state in files.items():
            copier = _FileCopier(self, name)
            staged[name] = _map(state, copier)
            total += copier.nbytes
        event = None
        if self.pin and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
        return StagedState(staged, total, event)

    def layout(self, files: dict[str, Any]) -> list[BufferSpec]:
        """The buffers ``stage(files)`` will use, without copying anything."""
        specs: list[BufferSpec] = []
        for name, state in files.items():
            copier = _FileCopier(self, name, specs=specs)
            _map(state, copier)
        return specs

    def allocate(self, specs: list[BufferSpec]) -> None:
        """Allocate (and touch, so the first save does not pay the page faults) the
        buffers of ``layout``; safe in a thread while nothing is being staged."""
        for key, shape, dtype in specs:
            self._buffer(key, shape, dtype, touch=True)

    def _buffer(
        self, key: tuple[str, int], shape: torch.Size, dtype: torch.dtype, *, touch: bool = False
    ) -> torch.Tensor:
        """The buffer kept under ``key``, (re)allocated when its shape or dtype changed;
        ``touch``: fault a new one in now (a copy into it would anyway)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            if touch:
                buf.zero_()
            self._buffers[key] = buf
        return buf


class _FileCopier:
    """Copies the tensors of one file's state, in order, into the staging's buffers; a
    view met again is the same host tensor."""

    def __init__(
        self, staging: HostStaging, name: str, specs: list[BufferSpec] | None = None
    ) -> None:
        self.staging = staging
        self.name = name
        self.nbytes = 0
        self._index = 0
        self._seen: dict[tuple[Any, ...], torch.Tensor] = {}
        self._specs = specs  # set: only record which buffers a copy would use

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _view_key(tensor)
        if key in self._seen:
            return self._seen[key]
        if self._specs is not None:
            self._specs.append(((self.name, self._index), tensor.shape, tensor.dtype))
            self._index += 1
            self._seen[key] = tensor
            return tensor
        buf = self.staging._buffer((self.name, self._index), tensor.shape, tensor.dtype)
        self._index += 1
        with torch.no_grad():
            buf.copy_(tensor.detach(), non_blocking=self.staging.pin)
        self.nbytes += buf.numel() * buf.element_size()
        self._seen[key] = buf
        return buf


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of the same memory."""
    if tensor.numel() == 0:
        return ("empty", id(tensor))
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def _map(obj: Any, copy_tensor: Any) -> Any:
    """``obj`` with every tensor replaced by ``copy_tensor(tensor)``, containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return copy_tensor(obj)
    if isinstance(obj, dict):
        mapped = {key: _map(value, copy_tensor) for key, value in obj.items()}
        if type(obj) is dict:
            return mapped
        rebuilt = copy.copy(obj)  # its class and attributes (a state dict's ``_metadata``)
        rebuilt.clear()
        rebuilt.update(mapped)
        return rebuilt
    if isinstance(obj, list):
        return [_map(value, copy_tensor) for value in obj]
    if isinstance(obj, tuple):
        values = [_map(value, copy_tensor) for value in obj]
        if hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*values)
        return type(obj)(values)  # a tuple, torch.Size, ...
    if isinstance(obj, _PLAIN):
        return obj
    return copy.deepcopy(obj)
