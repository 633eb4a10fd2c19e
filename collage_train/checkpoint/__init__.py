"""Atomic, rotating checkpoints in ``<run_dir>/checkpoints/step-N/``.

A checkpoint is written into a hidden temporary directory next to its final place,
flushed to disk, and renamed into place in one step: a crash mid-write leaves only a
hidden ``.step-N.tmp`` directory, never a ``step-N`` that looks complete. Only
directories holding ``meta.json`` (written last) count as checkpoints.

``meta.json`` lists every other file with its size and CRC-32 (``files``; under ZeRO each
rank checksums a share: ``manifest_share``); ``damage`` checks a checkpoint against it, so
a resume takes the newest intact one (``collage_train.run.resume``). No checkpoint file is
unpickled with code execution allowed: every ``.pt`` file, DeepSpeed's shards included, is
first verified with a restricted unpickler (``verify_checkpoint_files``). ``full_state``
reads any layout per parameter (``whole_tensor``: per-block state per element); ``universal``
and ``native`` write the others (``python -m collage_train.checkpoint convert``).
The layouts and the conversions: docs/design.md, "Checkpoint layouts".
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from collage_train.errors import CheckpointError

_STEP_DIR = re.compile(r"^step-(\d+)$")
META = "meta.json"
_SHARE = ".manifest-rank"  # prefix of a rank's share of the manifest, inside the temporary dir
_FAILED = ".failed-rank"  # prefix of a rank's note that its share will not come
_READ_BLOCK = 1 << 24


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


class _ChecksummingWriter:
    """A file handle that keeps the CRC-32 and the size of what went through it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.crc32 = 0
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def write_checksummed(path: Path, obj: Any) -> dict[str, int]:
    """``torch.save`` ``obj`` to ``path``, fsynced, and return its manifest entry (size and
    CRC-32, computed from the bytes as they are written: nothing is read back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        writer = _ChecksummingWriter(handle)
        torch.save(obj, writer)
        handle.flush()
        os.fsync(handle.fileno())
    return {"bytes": writer.bytes, "crc32": writer.crc32}


def checksum_file(path: Path) -> dict[str, int]:
    """The manifest entry of a file written by someone else (read back once)."""
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def write_manifest_share(tmp: Path, rank: int, entries: dict[str, dict[str, int]]) -> None:
    """Write this rank's manifest share (relative name -> size and CRC-32) into ``tmp``,
    for ``commit_checkpoint`` to gather into ``meta.json``; call it after its files.

    The share appears under its name whole (written aside, fsynced, renamed): rank 0
    takes its presence as the sign that this rank is done (``wait_for_shares``)."""
    data = json.dumps(entries).encode()
    part = tmp / f"{_SHARE}{rank}.json.part"
    _write_file(part, lambda handle: handle.write(data))
    os.rename(part, tmp / f"{_SHARE}{rank}.json")


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while block := handle.read(_READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _files(directory: Path) -> list[str]:
    """Relative names of the checkpoint files in ``directory`` (not meta or manifest shares)."""
    return sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.name != META and not path.name.startswith((_SHARE, _FAILED))
    )


def manifest_share(tmp: Path, rank: int, world_size: int) -> None:
    """Checksum this rank's share (every ``world_size``-th file) of the files in ``tmp``
    and write it beside them; ``commit_checkpoint`` gathers the shares into ``meta.json``.
    Call it on every rank once all ranks have written their files."""
    share = {
        name: checksum_file(tmp / name)
        for index, name in enumerate(_files(tmp))
        if index % world_size == rank
    }
    write_manifest_share(tmp, rank, share)


def written_files(directory: Path) -> list[str]:
    """Relative names of the files written so far into a checkpoint's temporary directory."""
    return _files(directory)


def write_share_failure(tmp: Path, rank: int, reason: str) -> None:
    """Tell rank 0's ``wait_for_shares`` that this rank's share will not come, and why
    (best effort: the file system itself may be what failed)."""
    with contextlib.suppress(OSError):
        part = tmp / f"{_FAILED}{rank}.part"
        part.write_text(reason)
        os.rename(part, tmp / f"{_FAILED}{rank}")


def wait_for_shares(tmp: Path, world_size: int, *, timeout: float, poll: float) -> None:
    """Wait until every rank's manifest share is in ``tmp`` (ranks write into one shared
    directory); raise ``CheckpointError`` when a rank reports a failure or the shares do
    not all come within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    expected = {f"{_SHARE}{rank}.json" for rank in range(world_size)}
    while True:
        present = {path.name for path in tmp.iterdir()}
        failed = sorted(
            name for name in present if name.startswith(_FAILED) and not name.endswith(".part")
        )
        if failed:
            reason = (tmp / failed[0]).read_text().strip()
            raise CheckpointError(
                f"rank {failed[0][len(_FAILED) :]} could not write its part ({reason})"
            )
        missing = expected - present
        if not missing:
            return
        if time.monotonic() > deadline:
            ranks = sorted(int(name[len(_SHARE) : -len(".json")]) for name in missing)
            raise CheckpointError(
                f"ranks {ranks} did not finish writing their part within {timeout:.0f} s "
                f"(is {tmp.parent} on a file system every rank shares?)"
            )
        time.sleep(poll)


def _gather_manifest(tmp: Path) -> dict[str, dict[str, int]]:
    files: dict[str, dict[str, int]] = {}
    for share in sorted(tmp.glob(f"{_SHARE}*.json")):
        files.update(json.loads(share.read_text()))
        share.unlink()
    missing = sorted(set(_files(tmp)) - set(files))
    if missing:  # a file no rank checksummed: written after the shares (a bug), never silently
        raise CheckpointError(f"the checkpoint in {tmp} has files without a checksum: {missing}")
    return files


def seal(tmp: Path, meta: dict[str, Any], extra_files: dict[str, bytes] | None = None) -> None:
    """Write extra files, then ``meta.json`` (last) listing every file of ``tmp`` with its
    size and CRC-32: the ranks' shares written by ``manifest_share`` (computed here for a
    single writer that wrote none) and the extra files."""
    if not list(tmp.glob(f"{_SHARE}*.json")):
        manifest_share(tmp, 0, 1)
    files = _gather_manifest(tmp)
    for name, data in (extra_files or {}).items():
        _write_file(tmp / name, lambda handle, data=data: handle.write(data))
        files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    meta_bytes = json.dumps({**meta, "files": files}, indent=2).encode()
    _write_file(tmp / META, lambda handle: handle.write(meta_bytes))
    _fsync_dir(tmp)


def commit_checkpoint(
    run_dir: Path,
    step: int,
    tmp: Path,
    meta: dict[str, Any],
    keep: int,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """``seal`` ``tmp`` with ``meta`` and the extra files, then rename it to ``step-N``.

    Replaces an existing checkpoint of the same step, then deletes all but the
    newest ``keep`` checkpoints. Returns the checkpoint's directory.
    """
    root = checkpoint_dir(run_dir)
    seal(tmp, {"step": step, **meta}, extra_files)

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


def begin_new_directory(out: Path) -> Path:
    """The hidden temporary directory ``.NAME.tmp`` beside ``out`` that a converted
    checkpoint is written into (a stale one of a crashed writer is removed first);
    ``out`` must not exist."""
    if out.exists():
        raise CheckpointError(f"{out} already exists; name a new directory")
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_directory(
    tmp: Path, out: Path, meta: dict[str, Any], extra_files: dict[str, bytes]
) -> Path:
    """Make every file in ``tmp`` durable, ``seal`` it (``meta.json`` last) and rename it
    to ``out``: a crash before the rename leaves only the hidden ``tmp``."""
    for file in tmp.rglob("*"):  # files written by safetensors or json are not fsynced yet
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    seal(tmp, meta, extra_files)
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    return out


def remove_temporary_dirs(run_dir: Path) -> None:
    """Delete the hidden directories of unfinished checkpoint writes (never a complete one)."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for partial in root.glob(".step-*.tmp*"):
            shutil.rmtree(partial, ignore_errors=True)


# The only objects besides tensors and plain containers that DeepSpeed 0.19.8 pickles into
# a ZeRO checkpoint (stages 1-3, bf16 or fp32 masters; found by listing the globals of its
# files). While a file is verified each is read into a ``_Record``, so verifying neither
# imports DeepSpeed nor runs any of its code.
DEEPSPEED_RECORDS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class _Record:
    """Inert stand-in for one of DEEPSPEED_RECORDS: keeps its arguments and state, runs nothing."""

    def __init__(self, *args: Any) -> None:
        self.args = args


def _refusal(file: Path, err: BaseException) -> CheckpointError:
    """The one-line reason why ``file`` was not loaded."""
    text = str(err)
    found = re.search(r"Unsupported (?:global|operand): (?:GLOBAL )?(\S+)", text)
    if found or "Weights only load failed" in text:
        detail = f" ({found.group(1)})" if found else ""
        return CheckpointError(
            f"refusing to load {file}: it holds an object that is not a tensor or a plain "
            f"container{detail}, and checkpoint files are never allowed to run code while "
            "they are read; restore the checkpoint from a trusted copy or delete it"
        )
    if "mmap can only be used" in text:
        return CheckpointError(f"{file} is not a checkpoint file written by torch.save")
    first = (text.strip().splitlines() or [type(err).__name__])[0]
    return CheckpointError(f"{file} is not a readable checkpoint file ({first})")


def verify_checkpoint_files(path: Path) -> None:
    """Refuse checkpoint ``path`` unless every ``.pt`` file in it unpickles safely.

    Each file is read with ``weights_only=True`` and its storages memory-mapped, so this
    parses the pickles without reading the tensor data. Call it before anything that
    loads the files less strictly (DeepSpeed's engine and ``zero_to_fp32``) opens them.
    """
    for file in sorted(path.rglob("*.pt")):
        open_restricted(file)


def open_restricted(file: Path) -> Any:
    """The contents of a checkpoint's ``.pt`` file, DeepSpeed's shards included, read with
    the restricted unpickler (DeepSpeed's records become inert ``_Record``s) and its
    storages memory-mapped: a tensor's data is read from disk only where it is used."""
    allowed = [(_Record, name) for name in DEEPSPEED_RECORDS]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, OSError) as err:
        raise _refusal(file, err) from None


def load_checkpoint_file(path: Path, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Load ``NAME.pt`` from a checkpoint directory (tensors and plain containers only)."""
    file = path / f"{name}.pt"
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, EOFError) as err:
        raise _refusal(file, err) from None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def damage(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Why checkpoint ``path`` cannot be trusted, or None when it is intact.

    Every rank checks that ``meta.json`` parses and that every listed file exists with
    its size; the CRC-32 of each ``world_size``-th file is checked by this ``rank`` (so the
    ranks of a launch share the reading). A checkpoint written before checksums were
    recorded (no ``files``) passes on its metadata alone.
    """
    try:
        meta = read_meta(path)
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            return "meta.json does not describe a checkpoint"
    except (OSError, ValueError) as err:
        return f"meta.json is unreadable ({type(err).__name__})"
    files = meta.get("files")
    if files is None:
        return None
    for index, (name, expected) in enumerate(sorted(files.items())):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{name} holds {size} bytes, {expected['bytes']} were written"
        if index % world_size == rank and _crc32(file) != expected["crc32"]:
            return f"{name} does not match the checksum written with it"
    return None
