"""Atomic, rotating checkpoints in ``<run_dir>/checkpoints/step-N/``.

A checkpoint is written into a hidden temporary directory next to its final place,
flushed to disk, and renamed into place in one step: a crash mid-write leaves only a
hidden ``.step-N.tmp`` directory, never a ``step-N`` that looks complete. Only
directories holding ``meta.json`` (written last) count as checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_STEP_DIR = re.compile(r"^step-(\d+)$")
META = "meta.json"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write) -> None:
    with path.open("wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def temporary_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is renamed into place."""
    return checkpoint_dir(run_dir) / f".step-{step}.tmp"


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """Create the hidden directory that the checkpoint of ``step`` is written into.

    Stale temporary directories of crashed writers are removed first. The name is the
    same on every rank, so that all ranks of a distributed run can write their shards
    into it (the run directory must then be on a shared file system).
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = temporary_dir(run_dir, step)
    tmp.mkdir()
    return tmp


def write_tensors(directory: Path, tensors: dict[str, Any]) -> None:
    """One fsynced ``NAME.pt`` per entry of ``tensors``."""
    for name, obj in tensors.items():
        _write_file(directory / f"{name}.pt", lambda handle, obj=obj: torch.save(obj, handle))


def commit_checkpoint(
    run_dir: Path,
    step: int,
    tmp: Path,
    meta: dict[str, Any],
    keep: int,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write extra files and ``meta.json`` into ``tmp``, then rename it to ``step-N``.

    Replaces an existing checkpoint of the same step, then deletes all but the newest
    ``keep`` checkpoints. Returns the checkpoint's directory.
    """
    root = checkpoint_dir(run_dir)
    for name, data in (extra_files or {}).items():
        _write_file(tmp / name, lambda handle, data=data: handle.write(data))
    meta_bytes = json.dumps({"step": step, **meta}, indent=2).encode()
    _write_file(tmp / META, lambda handle: handle.write(meta_bytes))
    _fsync_dir(tmp)

    final = root / f"step-{step}"
    if final.exists():
        retired = root / f".step-{step}.tmp-old"
        os.rename(final, retired)
        os.rename(tmp, final)
        shutil.rmtree(retired)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)

    for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def save_checkpoint(
    run_dir: Path,
    step: int,
    tensors: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Single-writer shorthand: ``begin_checkpoint``, ``write_tensors``, ``commit_checkpoint``."""
    tmp = begin_checkpoint(run_dir, step)
    write_tensors(tmp, tensors)
    return commit_checkpoint(run_dir, step, tmp, meta, keep, extra_files)


def load_checkpoint_file(path: Path, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Load ``NAME.pt`` from a checkpoint directory (tensors and plain containers only)."""
    return torch.load(path / f"{name}.pt", map_location=map_location, weights_only=True)


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())
