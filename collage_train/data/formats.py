"""Readers that stream documents out of .txt, .jsonl and .parquet files."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from collage_train.data.errors import DataError

PARQUET_BATCH_ROWS = 1024


def read_txt(path: Path, text_field: str) -> Iterator[str]:
    """Yield the whole file as one document; ``text_field`` does not apply to plain text."""
    yield path.read_text(encoding="utf-8", errors="replace")


def read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    """Yield the ``text_field`` string of every JSON object, one object per line."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else []
                raise DataError(
                    f"{path}:{line_number}: no field {text_field!r} (fields: {keys}); "
                    "set data.text_field"
                )
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{line_number}: field {text_field!r} must be a string, "
                    f"not {type(text).__name__}"
                )
            yield text


def read_parquet(path: Path, text_field: str) -> Iterator[str]:
    """Yield column ``text_field`` of every row, reading the file in record batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        if text_field not in schema.names:
            raise DataError(
                f"{path}: no column {text_field!r} (columns: {schema.names}); set data.text_field"
            )
        column_type = schema.field(text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise DataError(f"{path}: column {text_field!r} has type {column_type}, not string")
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text
    except (pa.ArrowException, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(
            f"{path} is not a readable parquet file ({first}); fix or remove it from data.paths"
        ) from None


READERS: dict[str, Callable[[Path, str], Iterator[str]]] = {
    ".txt": read_txt,
    ".jsonl": read_jsonl,
    ".parquet": read_parquet,
}
