"""Document sources: stream the text of the configured corpus and fingerprint it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from collage_train.data.errors import DataError
from collage_train.data.formats import READERS, read_txt
from collage_train.data.settings import DataSettings

# Not code a person wrote: installed packages, caches, test suites, and the codec tables
# of encodings/ (1.4 of the library's 12 MB, mostly hex literals a small model learns to
# repeat)
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
)
HASH_CHUNK_BYTES = 1 << 20

Reader = Callable[[Path, str], Iterator[str]]


class Source(Protocol):
    """A corpus that can be streamed document by document."""

    def documents(self) -> Iterator[str]:
        """Yield the non-blank documents of the corpus, at most ``max_documents`` of them."""
        ...

    def fingerprint(self) -> str:
        """Return a stable hex digest that changes whenever the documents would change."""
        ...

    def metadata(self) -> dict[str, Any]:
        """Return a JSON-serialisable description of the corpus."""
        ...


@dataclass(frozen=True)
class SourceFile:
    """One input file, the stable name used for fingerprinting it, and its reader."""

    path: Path
    name: str
    reader: Reader


@dataclass(frozen=True)
class FileSetSource:
    """A corpus made of local files (the Python standard library or ``data.paths``)."""

    kind: str
    files: tuple[SourceFile, ...]
    text_field: str
    max_documents: int | None
    description: str
    extra_metadata: dict[str, Any]

    def documents(self) -> Iterator[str]:
        """Yield the documents of every file in order."""
        texts = (text for f in self.files for text in f.reader(f.path, self.text_field))
        return limit_documents(texts, self.max_documents, self.description)

    def fingerprint(self, file_digest: Callable[[Path], str] | None = None) -> str:
        """Hash the settings and the (name, size, content digest) of every file.

        ``file_digest`` (default: SHA-256 of the bytes) may answer from a cache of digests.
        """
        digest_of = file_digest or sha256_of_file
        digest = hashlib.sha256()
        header = {"kind": self.kind, "text_field": self.text_field, "max": self.max_documents}
        digest.update(json.dumps(header, sort_keys=True).encode())
        for source_file in self.files:
            size = source_file.path.stat().st_size
            digest.update(f"\0{source_file.name}\0{size}\0{digest_of(source_file.path)}".encode())
        return digest.hexdigest()

    def metadata(self) -> dict[str, Any]:
        """Describe the source: kind, file count, total bytes and source-specific fields."""
        total_bytes = sum(f.path.stat().st_size for f in self.files)
        return {
            "source": self.kind,
            "num_files": len(self.files),
            "bytes": total_bytes,
            "max_documents": self.max_documents,
            **self.extra_metadata,
        }


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face ``datasets`` corpus (hub name or local path), loaded lazily.

    ``revision`` pins a hub commit, branch or tag (``data.revision``).
    """

    name: str
    config_name: str | None
    split: str
    streaming: bool
    data_files: tuple[str, ...] | None
    text_field: str
    max_documents: int | None
    revision: str | None = None

    def documents(self) -> Iterator[str]:
        """Yield ``row[text_field]`` for every row of the split."""
        return limit_documents(self._texts(), self.max_documents, f"dataset {self.name}")

    @cached_property
    def dataset(self) -> Any:
        """The loaded split (an ``IterableDataset`` when streaming), loaded once."""
        import datasets

        try:
            return datasets.load_dataset(
                self.name,
                self.config_name,
                split=self.split,
                streaming=self.streaming,
                data_files=None if self.data_files is None else list(self.data_files),
                revision=self.revision,
            )
        except (OSError, ValueError) as exc:
            raise DataError(f"data.name: could not load dataset {self.name!r} ({exc})") from exc

    def _texts(self) -> Iterator[str]:
        """Yield the text field of each row of the dataset, checking that it exists."""
        dataset = self.dataset
        columns = dataset.column_names
        if columns is not None and self.text_field not in columns:
            raise self._missing_field(columns)
        for row in dataset:
            if self.text_field not in row:
                raise self._missing_field(list(row))
            text = row[self.text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"data.text_field: column {self.text_field!r} of dataset {self.name!r} "
                    f"holds {type(text).__name__} values, not strings"
                )
            yield text

    def _missing_field(self, columns: Iterable[str]) -> DataError:
        """Build the error for a text field that the dataset does not have."""
        return DataError(
            f"data.text_field: dataset {self.name!r} has no column {self.text_field!r} "
            f"(columns: {sorted(columns)})"
        )

    def fingerprint(self) -> str:
        """Hash the dataset reference and, unless streaming, the loaded data's fingerprint.

        ``datasets`` derives that fingerprint from the resolved hub revision or the local data
        files, so a changed dataset gets a new cache entry instead of stale shards. A stream
        is only identified by its reference (pin ``data.revision`` to make it exact).
        """
        identity = self.metadata()
        if not self.streaming:
            dataset = self.dataset
            identity["content"] = getattr(dataset, "_fingerprint", None) or [
                f["filename"] for f in dataset.cache_files
            ]
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def metadata(self) -> dict[str, Any]:
        """Describe the dataset reference."""
        return {
            "source": "hf",
            "name": self.name,
            "config_name": self.config_name,
            "split": self.split,
            "revision": self.revision,
            "data_files": None if self.data_files is None else list(self.data_files),
            "text_field": self.text_field,
            "max_documents": self.max_documents,
        }


def sha256_of_file(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def limit_documents(
    texts: Iterable[str], max_documents: int | None, description: str
) -> Iterator[str]:
    """Skip blank documents, stop after ``max_documents``, and fail if nothing was found."""
    count = 0
    for text in texts:
        if not text.strip():
            continue
        yield text
        count += 1
        if count == max_documents:
            return
    if count == 0:
        raise DataError(f"no text found in {description}")


def stdlib_files() -> tuple[SourceFile, ...]:
    """List the standard library's .py files (no tests, caches or site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirectories, filenames in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in STDLIB_EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py") and not filename.startswith("test_"):
                path = Path(directory, filename)
                found.append(SourceFile(path, path.relative_to(root).as_posix(), read_txt))
    return tuple(sorted(found, key=lambda f: f.name))


def collect_files(paths: Iterable[str]) -> tuple[SourceFile, ...]:
    """Expand ``data.paths`` into supported files; directories are searched recursively."""
    found: list[SourceFile] = []
    for index, raw in enumerate(paths):
        path = Path(raw).expanduser()
        if not path.exists():
            raise DataError(f"data.paths: {raw} does not exist")
        if path.is_dir():
            inside = sorted(
                (p for p in path.rglob("*") if p.suffix.lower() in READERS and p.is_file()),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not inside:
                raise DataError(f"data.paths: {raw} contains no .txt, .jsonl or .parquet files")
            found.extend(
                SourceFile(p, f"{index}/{p.relative_to(path).as_posix()}", reader_for(p))
                for p in inside
            )
        elif path.suffix.lower() in READERS:
            found.append(SourceFile(path, f"{index}/{path.name}", reader_for(path)))
        else:
            raise DataError(
                f"data.paths: {raw} has unsupported extension {path.suffix!r}; "
                "use .txt, .jsonl or .parquet"
            )
    return tuple(found)


def reader_for(path: Path) -> Reader:
    """Return the reader for a supported file extension."""
    return READERS[path.suffix.lower()]


def open_source(settings: DataSettings) -> Source:
    """Create the source selected by ``settings.source``."""
    if settings.source == "stdlib":
        return FileSetSource(
            kind="stdlib",
            files=stdlib_files(),
            text_field=settings.text_field,
            max_documents=settings.max_documents,
            description="the Python standard library",
            extra_metadata={"python_version": platform.python_version()},
        )
    if settings.source == "files":
        return FileSetSource(
            kind="files",
            files=collect_files(settings.paths),
            text_field=settings.text_field,
            max_documents=settings.max_documents,
            description=", ".join(settings.paths),
            extra_metadata={"paths": list(settings.paths)},
        )
    assert settings.name is not None
    return HFSource(
        name=settings.name,
        config_name=settings.config_name,
        split=settings.split,
        streaming=settings.streaming,
        data_files=settings.data_files,
        text_field=settings.text_field,
        max_documents=settings.max_documents,
        revision=settings.revision,
    )
