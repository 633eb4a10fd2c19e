"""The weight files of a local Hugging Face model directory, read one tensor at a time.

``WeightFiles`` opens what ``save_pretrained`` writes (``model.safetensors``, or
``pytorch_model.bin``, each alone or sharded with its ``.index.json``; safetensors first, as
transformers prefers them) and hands out each tensor by its name in the files, in the dtype
stored there. Nothing is read ahead and nothing is copied: a safetensors file is
memory-mapped and each tensor is a view of its bytes (its header parsed here, format of
huggingface/safetensors), a ``.bin`` file is loaded by torch's restricted unpickler
(``weights_only``) with its storages memory-mapped. The pages read belong to the page cache,
which every rank of a node shares, not to any process's own memory; a caller copies what
it needs (``model.materialise.materialise``: into one unit's fp32 tensors at a time).

Damaged or foreign files raise what reading them raises (ValueError, OSError, KeyError,
RuntimeError, pickle.UnpicklingError): the caller turns it into one line.
"""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import torch

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
WEIGHT_FILES = (*SAFETENSORS, *PICKLED)  # transformers' order of preference

# safetensors' dtype names (its format's specification)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Safetensors:
    """One safetensors file, memory-mapped: its header parsed, its tensors views."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as handle:  # a private mapping: writable views, file untouched
            self.mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        size = len(self.mapped)
        length = int.from_bytes(self.mapped[:8], "little") if size >= 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"{path.name} is not a safetensors file (no header)")
        header = json.loads(self.mapped[8 : 8 + length])
        if not isinstance(header, dict):
            raise ValueError(f"{path.name}: its safetensors header is not an object")
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for key, info in header.items():
            dtype = _DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
            if dtype is None:
                raise ValueError(f"{path.name}: tensor {key} has no dtype torch reads")
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
                raise ValueError(f"{path.name}: tensor {key} lies outside the file")
            self.entries[key] = (dtype, shape, 8 + length + begin)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def tensor(self, key: str) -> torch.Tensor:
        dtype, shape, offset = self.entries[key]
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        view = torch.frombuffer(self.mapped, dtype=dtype, count=count, offset=offset)
        return view.reshape(shape)


class _Pickled:
    """One ``pytorch_model.bin``, unpickled with weights only, its storages memory-mapped
    (a file in torch's legacy format, which cannot be mapped, is read whole)."""

    def __init__(self, path: Path) -> None:
        try:
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            self.tensors = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(self.tensors, dict):
            raise ValueError(f"{path.name} holds no state dict")

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class WeightFiles:
    """The tensors of a directory's weight files by their names there (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        name = next((n for n in WEIGHT_FILES if (directory / n).is_file()), None)
        if name is None:
            raise FileNotFoundError(f"no {' or '.join(WEIGHT_FILES[::2])} in {directory}")
        self.kind = _Safetensors if name in SAFETENSORS else _Pickled
        self._files: dict[str, _Safetensors | _Pickled] = {}
        if name.endswith(".index.json"):
            index = json.loads((directory / name).read_text())
            self.file_of: dict[str, str] = dict(index["weight_map"])
        else:
            self.file_of = dict.fromkeys(self._open(name).names(), name)

    def _open(self, name: str) -> _Safetensors | _Pickled:
        if name not in self._files:
            self._files[name] = self.kind(self.directory / name)
        return self._files[name]

    def keys(self) -> list[str]:
        return list(self.file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._open(self.file_of[key]).shape(key)

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor named ``key``, in its stored dtype, viewing the mapped file."""
        return self._open(self.file_of[key]).tensor(key)
