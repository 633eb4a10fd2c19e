"""What an offline W&B run holds, read back from its ``.wandb`` file.

wandb 0.31 ships no Python reader of its run files (``wandb.sdk.internal.datastore`` is
gone; wandb-core writes and replays them), but the format is the one ``wandb sync``
replays: a 7-byte header (``:W&B``, magic, version) and then LevelDB-log records in 32 KiB
blocks (4-byte checksum, 2-byte length, 1-byte type: full, first, middle, last), each a
``wandb_internal.Record`` protobuf, parsed with wandb's own ``wandb.proto`` classes.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

from collage_train.metrics.sinks import wandb_key

_BLOCK = 32 * 1024
_HEADER = 7  # of the file and of each record
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """Every complete record of the run file ``path``, in the order written."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pieces = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        payload = data[pos + _HEADER : pos + _HEADER + length]
        if kind == 0 or len(payload) < length:  # zero padding, or the torn end of a write
            pos += left
            continue
        pos += _HEADER + length
        if kind == _FULL:
            yield wandb_internal_pb2.Record.FromString(payload)
        elif kind == _FIRST:
            pieces = payload
        elif kind == _MIDDLE:
            pieces += payload
        elif kind == _LAST:
            yield wandb_internal_pb2.Record.FromString(pieces + payload)


def history(path: Path) -> list[dict[str, Any]]:
    """The history rows of the run file ``path`` as W&B keeps them: ``{"_step": ..., key:
    value}``, values decoded from their JSON."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            })  # fmt: skip
    return rows


def run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The run files of W&B run ``run_id`` under ``wandb_dir``, one per process that logged
    to it, oldest first, once wandb-core has written each to its end (the exit record:
    it may still be flushing after ``finish()``)."""
    # a second process of the run within the same second gets the folder name plus "-1"
    files = list(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    for _ in range(100):
        if all(_ended(file) for file in files):
            break
        time.sleep(0.1)
    return sorted(files, key=lambda file: run_record(file).start_time.ToNanoseconds())


def _ended(path: Path) -> bool:
    return any(record.WhichOneof("record_type") == "exit" for record in records(path))


def run_record(path: Path) -> wandb_internal_pb2.RunRecord:
    """The run record of the run file ``path`` (id, resume flag, branch point)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def assert_holds(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Every metric record (as a sink gets it) is in W&B's history ``rows``: a row at its
    training step (``step``) with each of its values under its W&B name (NaN as NaN)."""
    for record in records:
        held = [row for row in rows if row.get("step") == record["step"]]
        assert any(
            all(
                _same(row.get(wandb_key(key)), value)
                for key, value in record.items()
                if key != "step" and value is not None
            )
            for row in held
        ), (record, held)


def _same(logged: Any, value: Any) -> bool:
    if isinstance(value, float) and math.isnan(value):
        return isinstance(logged, float) and math.isnan(logged)
    return logged == value


def _items(updates: Any) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def config(path: Path) -> dict[str, Any]:
    """The run's config as the run file ``path`` holds it (its run record's, then every
    config update), each top-level key's value decoded from its JSON."""
    held: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            held.update(_items(record.run.config.update))
        elif kind == "config":
            held.update(_items(record.config.update))
    return {key: value.get("value", value) if isinstance(value, dict) else value
            for key, value in held.items()}  # fmt: skip


def summary(path: Path) -> dict[str, Any]:
    """The run's summary as the run file ``path`` holds it (the last value of each key)."""
    held: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            held.update(_items(record.summary.update))
    return held
