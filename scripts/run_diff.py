"""Whether two run directories, or two prepared-data caches, hold the same results bit for bit.

``compare_runs(a, b)`` reads each run's records (``metrics.jsonl``, ``summary.json``) and
state (every file under ``checkpoints/`` and ``hf/``) and returns a ``RunDiff``: the
training steps the records cover and the differences of each part (records, weights,
optimizer), in order. Values are compared field by field, without the fields that
measure time, memory or throughput or name a machine path (``VOLATILE``); tensors by
dtype, shape and bits; other values by type and value, floats by their bits (NaN equals
NaN, -0.0 differs from 0.0). ``compare_caches(a, b)`` does the same for the files of two
``data.cache_dir`` directories. scripts/compare_revisions.py runs the runs it compares.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collage_train import checkpoint

# keys (any level, holding no tensor) left out: timings, memory, throughput, probes, paths,
# versions, a checkpoint's byte counts and CRCs of its pickles (their contents are compared)
VOLATILE = re.compile(r"time|_s(_|$)|per_s|mem|mfu|gflops|cache_dir|^versions$|^files$")
STATE_DIRS = ("checkpoints", "hf")
# files of a state directory that are not state: DeepSpeed's conversion scripts, locks
NOT_STATE = re.compile(r"\.py$|(^|/)\.lock$")
# files of a data cache that are not data: locks, progress lines, the digest memo
NOT_DATA = re.compile(r"(^|/)(\.lock|progress\.json|file-digests\.json)$|(^|/)\.[^/]*\.tmp(/|$)")
SHOWN = 20  # differences kept per part
PARTS = ("records", "weights", "optimizer")


@dataclass
class RunDiff:
    """What differs between two runs: ``steps``, the training steps in A's records; per part
    (``PARTS``) the first ``SHOWN`` differences as lines, in order, and how many in all."""

    steps: int
    lines: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in PARTS})
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def add(self, part: str, line: str) -> None:
        self.counts[part] += 1
        if len(self.lines[part]) < SHOWN:
            self.lines[part].append(line)

    def equal(self, part: str | None = None) -> bool:
        """No difference (in ``part``, or in any)."""
        return not any(self.counts[p] for p in ([part] if part else PARTS))

    def first(self) -> str | None:
        """The first difference: in the records (the earliest step), then the weights, then
        the optimizer state."""
        return next((lines[0] for lines in self.lines.values() if lines), None)


# ------------------------------------------------------------------ values


def flatten(value: Any, path: str = "", volatile: re.Pattern | None = None) -> dict[str, Any]:
    """``value`` as ``{path: leaf}``: mappings and sequences opened (their keys joined by
    ``/``), objects by their attributes; keys matching ``volatile`` left out unless they
    hold a tensor (a checkpoint's timing counters go, its tensors stay). Leaves are
    tensors, numbers, strings, None, a numpy array's dtype, shape and digest, and the
    ``repr`` of anything else."""
    if isinstance(value, Mapping):
        kept = {
            key: item
            for key, item in value.items()
            if volatile is None or not volatile.search(str(key)) or _holds_tensor(item)
        }
        if not kept:
            return {path: "{}"}
        out: dict[str, Any] = {}
        for key, item in kept.items():
            out.update(flatten(item, f"{path}/{key}" if path else str(key), volatile))
        return out
    if isinstance(value, list | tuple):
        if not value:
            return {path: "[]"}
        out = {}
        for index, item in enumerate(value):
            out.update(flatten(item, f"{path}/{index}" if path else str(index), volatile))
        return out
    if torch.is_tensor(value) or value is None or isinstance(value, bool | int | float | str):
        return {path: value}
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a numpy array or scalar
        digest = hashlib.sha256(value.tobytes()).hexdigest()[:16]
        return {path: f"{type(value).__name__} {value.dtype}{getattr(value, 'shape', ())} {digest}"}
    if hasattr(value, "__dict__"):
        return flatten(vars(value), f"{path}:{type(value).__name__}", volatile)
    return {path: repr(value)}


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(item) for item in value)
    return torch.is_tensor(value)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their width (its bits, one per element)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    width = flat.element_size()
    if width in ints and flat.dtype != torch.bool:
        return flat.view(ints[width])
    return flat.view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Equal bit for bit: tensors by dtype, shape and bits, floats by bits, the rest by
    type and value."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a)
            and torch.is_tensor(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def describe(a: Any, b: Any) -> str:
    """How two unequal leaves differ, in a few words."""
    if torch.is_tensor(a) and torch.is_tensor(b):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        differ = _bits(a) != _bits(b)
        text = f"{int(differ.sum())} of {differ.numel()} elements differ"
        if a.is_floating_point():
            gap = (a.double() - b.double()).abs().reshape(-1)[differ].max().item()
            text += f", largest difference {gap:.3g}"
        return text
    return f"{_short(a)} != {_short(b)}"


def _short(value: Any) -> str:
    text = f"tensor {value.dtype}{tuple(value.shape)}" if torch.is_tensor(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(a: dict[str, Any], b: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(key, how)`` for each key of two flat mappings whose leaves differ, or that only
    one has."""
    for key, value in a.items():
        if key not in b:
            if not _added_setting(key, value):
                yield key, "only in A"
        elif not same(value, b[key]):
            yield key, describe(value, b[key])
    for key in b:
        if key not in a and not _added_setting(key, b[key]):
            yield key, "only in B"


def _added_setting(key: str, value: Any) -> bool:
    """A config key one revision has and the other lacks, unset (None): a setting added
    (e.g. ``train.branch_from``), which changes no number the runs compute."""
    return value is None and (key.startswith("config/") or "/config/" in key)


# ------------------------------------------------------------------ files


def load_flat(path: Path) -> dict[str, Any]:
    """A file's contents as a flat mapping without ``VOLATILE`` keys: a ``.pt`` pickle
    (with the checkpoints' restricted unpickler: DeepSpeed's records as inert records), a
    ``.safetensors`` file's tensors, JSON, or the SHA-256 of any other file."""
    if path.suffix == ".pt":
        return flatten(checkpoint.open_restricted(path), volatile=VOLATILE)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return flatten(load_file(path))
    if path.suffix == ".json":
        return flatten(json.loads(path.read_text()), volatile=VOLATILE)
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _files(root: Path, skip: re.Pattern, under: tuple[str, ...] = ("",)) -> dict[str, Path]:
    """The files under ``root/<each of under>``, by path relative to ``root``, but ``skip``."""
    found = {}
    for sub in under:
        base = root / sub if sub else root
        if base.is_dir():
            for path in base.rglob("*"):
                name = path.relative_to(root).as_posix()
                if path.is_file() and not skip.search(name):
                    found[name] = path
    return dict(sorted(found.items()))


def compare_files(a: dict[str, Path], b: dict[str, Path]) -> Iterator[tuple[str, str, str]]:
    """``(file, key, how)`` for each difference of two sets of files (by relative name),
    file by file; ``key`` is empty where a whole file is only on one side."""
    for name in sorted(a.keys() | b.keys()):
        if name not in b:
            yield name, "", "only in A"
        elif name not in a:
            yield name, "", "only in B"
        else:
            for key, how in differences(load_flat(a[name]), load_flat(b[name])):
                yield name, key, how


def read_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none where it is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_records(a: list[dict], b: list[dict]) -> Iterator[str]:
    """The differences of two runs' metric records, record by record in order."""
    for index, (mine, theirs) in enumerate(zip(a, b, strict=False)):
        where = f"metrics.jsonl record {index + 1} (step {mine.get('step')})"
        mine, theirs = flatten(mine, volatile=VOLATILE), flatten(theirs, volatile=VOLATILE)
        for key, how in differences(mine, theirs):
            yield f"{where}: {key}: {how}"
    if len(a) != len(b):
        yield f"metrics.jsonl: {len(a)} records in A, {len(b)} in B"


def _line(name: str, key: str, how: str) -> str:
    return f"{name}: {key}: {how}" if key else f"{name}: {how}"


def _existing(run: Path, name: str) -> dict[str, Path]:
    return {name: run / name} if (run / name).is_file() else {}


def compare_runs(a: Path, b: Path) -> RunDiff:
    """What differs between run directories ``a`` and ``b`` (see the module docstring).
    A file or key named ``optim...`` is optimizer state; the rest of the checkpoints
    (weights, the trainer's loader, random and guard state) and ``hf/`` are weights."""
    records_a, records_b = read_records(a / "metrics.jsonl"), read_records(b / "metrics.jsonl")
    diff = RunDiff(len({r["step"] for r in records_a if "loss" in r}))
    for side, records in (("A", records_a), ("B", records_b)):
        if not records:
            diff.add("records", f"metrics.jsonl missing or empty in {side}")
    for line in compare_records(records_a, records_b):
        diff.add("records", line)
    summary = "summary.json"
    for name, key, how in compare_files(_existing(a, summary), _existing(b, summary)):
        diff.add("records", _line(name, key, how))
    state_a, state_b = _files(a, NOT_STATE, STATE_DIRS), _files(b, NOT_STATE, STATE_DIRS)
    if not state_a and not state_b:
        diff.add("weights", "no checkpoints/ or hf/ in either run")
    for name, key, how in compare_files(state_a, state_b):
        optimizer = "optim" in Path(name).name or key.split("/")[0].startswith("optim")
        diff.add("optimizer" if optimizer else "weights", _line(name, key, how))
    return diff


def compare_caches(a: Path, b: Path) -> list[str]:
    """The differences of two prepared-data caches (tokenizers, shards, manifests), as
    lines; empty when both hold the same data."""
    return [_line(*found) for found in compare_files(_files(a, NOT_DATA), _files(b, NOT_DATA))]
