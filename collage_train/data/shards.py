"""Prepare a corpus into fixed-size token shards: in parallel, resumable, once per cache key.

``prepare_shards`` tokenizes the source into ``<cache>/<key>/`` where the key covers the
corpus content, the tokenizer and the shard size. Worker processes (``data.num_workers``,
every core by default) encode batches of documents; the main process appends their tokens,
each document followed by the end-of-text id, to ``shards/NNNNNN.bin`` files of exactly
``data.shard_tokens`` tokens (the last one shorter). A shard is written under a temporary
name and renamed, then its record ``NNNNNN.json`` (token count, first and next document
position, document ends in ``NNNNNN.ends``) the same way: a shard counts only once its
record exists, so ``kill -9`` loses at most the shard in flight and a new preparation
restarts from the position the last record names. ``manifest.json`` is written last and
atomically: its presence means the corpus is ready. One process prepares an entry at a
time (an ``flock`` on ``.lock``); the others, and the launched ranks that do not prepare,
wait for the manifest while printing the preparer's progress (``collage_train.data.progress``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from collage_train.data.cache import cache_key, remove_stale_staging, staged_directory
from collage_train.data.errors import DataError
from collage_train.data.mixture import InterleavedSource
from collage_train.data.progress import (
    PrepareProgress,
    wait_for_preparation,
    write_json_atomic,
)
from collage_train.data.settings import DataSettings
from collage_train.data.sources import FileSetSource, Source, open_source, sha256_of_file
from collage_train.data.store import (
    MANIFEST_FILENAME,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    check_prepared,
    load_manifest,
    token_dtype,
)
from collage_train.data.tokenizer import (
    MODEL_FILENAME,
    Tokenizer,
    TokenizerSettings,
    available_cpus,
    split_after_newlines,
    train_model,
    training_sentences,
)

logger = logging.getLogger(__name__)

PIPELINE_VERSION = 2
SHARDS_DIRNAME = "shards"
LOCK_FILENAME = ".lock"
PIECE_CHARS = 4096
TASK_CHARS = 1 << 18  # characters of text per worker task
TASK_DOCUMENTS = 512
PENDING_TASKS_PER_WORKER = 4
BYTES_PER_WORKER = 2 << 20
FILE_DIGESTS = "file-digests.json"


# ----------------------------------------------------------------- the entry


@dataclass(frozen=True)
class TokenizerPlan:
    """Which tokenizer an entry is prepared with: its identity in the cache key (known to
    every process without training it), and how the preparing process obtains it."""

    identity: dict[str, Any]
    obtain: Callable[[], Tokenizer]


def default_plan(settings: DataSettings, source: Source, fingerprint: str) -> TokenizerPlan:
    """``data.tokenizer`` if set, else a SentencePiece model trained on this corpus."""
    if settings.tokenizer is not None:
        given = Tokenizer.load(settings.tokenizer)
        return TokenizerPlan({"given": given.describe()}, lambda: given)
    trained = TokenizerSettings(settings.vocab_size, settings.tokenizer_train_chars)
    return TokenizerPlan(
        {"trained": trained.as_dict()},
        lambda: prepare_tokenizer(source, fingerprint, trained, settings.cache_dir),
    )


def prepare_shards(
    settings: DataSettings, *, prepare: bool = True, plan: TokenizerPlan | None = None
) -> Path:
    """Return the prepared corpus directory for ``settings``, preparing it if needed.

    With ``prepare`` false (a launched rank other than each node's first), wait for another
    process to prepare it instead. ``plan`` overrides the tokenizer (mixtures share one).
    """
    for stale in remove_stale_staging(settings.cache_dir):
        logger.info("removed %s, left by a preparation that was killed", stale)
    source = open_source(settings)
    fingerprint = source_fingerprint(source, settings.cache_dir)
    plan = plan or default_plan(settings, source, fingerprint)
    key = cache_key(
        {
            "fingerprint": fingerprint,
            "tokenizer": plan.identity,
            "shard_tokens": settings.shard_tokens,
            "version": PIPELINE_VERSION,
        }
    )
    target = settings.cache_dir / key
    manifest_path = target / MANIFEST_FILENAME
    if manifest_path.is_file():
        logger.info("reusing the prepared corpus in %s", target)
        return target
    target.mkdir(parents=True, exist_ok=True)
    if not prepare:
        wait_for_preparation(target, manifest_path)
        return target
    with preparation_lock(target) as holding:
        if not holding:
            wait_for_preparation(target, manifest_path)
            return target
        if manifest_path.is_file():  # finished by the holder we waited behind
            return target
        progress = PrepareProgress(target, source.metadata().get("bytes"))
        try:
            tokenizer = place_tokenizer(plan.obtain(), target)
            manifest = write_shards(
                source.documents(),
                tokenizer,
                target,
                settings.shard_tokens,
                settings.num_workers or default_workers(source.metadata().get("bytes")),
                progress,
            )
            manifest.update(
                key=key,
                fingerprint=fingerprint,
                source=source.metadata(),
                tokenizer={
                    **tokenizer.describe(),
                    "file": tokenizer.model_path.name,
                    "plan": plan.identity,
                },
            )
            write_json_atomic(manifest_path, manifest)
            progress.finish()
        except Exception as exc:
            progress.fail(exc)
            raise
        except BaseException:  # interrupted, not failed: a new run resumes it
            progress.beat(state="interrupted", force=True)
            raise
    return target


def prepare_mixture(settings: DataSettings, *, prepare: bool = True) -> list[Path]:
    """Prepare every source of ``data.mixture`` with one shared tokenizer, in order."""
    assert settings.mixture is not None
    entries = settings.mixture
    sources, fingerprints = [], []
    for entry in entries:
        try:
            source = open_source(entry.settings)
            fingerprints.append(source_fingerprint(source, settings.cache_dir))
        except DataError as exc:
            raise DataError(f"data.mixture ({entry.label}): {exc}") from None
        sources.append(source)
    if settings.tokenizer is not None:
        given = Tokenizer.load(settings.tokenizer)
        plan = TokenizerPlan({"given": given.describe()}, lambda: given)
    else:
        mixed = InterleavedSource(
            tuple(sources), tuple(e.weight for e in entries), tuple(fingerprints)
        )
        trained = TokenizerSettings(settings.vocab_size, settings.tokenizer_train_chars)
        plan = TokenizerPlan(
            {"trained_on_mixture": {"fingerprint": mixed.fingerprint(), **trained.as_dict()}},
            lambda: prepare_tokenizer(mixed, mixed.fingerprint(), trained, settings.cache_dir),
        )
    directories = []
    for entry in entries:
        try:
            directories.append(prepare_shards(entry.settings, prepare=prepare, plan=plan))
        except DataError as exc:
            raise DataError(f"data.mixture ({entry.label}): {exc}") from None
    return directories


def default_workers(total_bytes: int | None) -> int:
    """Every available core, but one process per 2 MiB of input (small corpora in-process)."""
    if total_bytes is None:
        return available_cpus()
    return max(1, min(available_cpus(), total_bytes // BYTES_PER_WORKER))


@contextmanager
def preparation_lock(directory: Path) -> Iterator[bool]:
    """Try to take the entry's lock without blocking; yield whether this process holds it."""
    with (directory / LOCK_FILENAME).open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def place_tokenizer(tokenizer: Tokenizer, directory: Path) -> Tokenizer:
    """Copy the tokenizer into the entry, refusing an entry begun with another tokenizer."""
    target = directory / tokenizer.canonical_filename()
    if target.exists():
        existing = Tokenizer.load(target)
        if existing.sha256() != tokenizer.sha256():
            raise DataError(
                f"{directory} holds shards of another tokenizer ({target.name} differs); "
                f"remove {directory} to prepare it again"
            )
        return existing
    copied = tokenizer.copy_to(directory)
    return Tokenizer.load(copied)


def prepare_tokenizer(
    source: Source, fingerprint: str, settings: TokenizerSettings, cache_dir: Path
) -> Tokenizer:
    """Load the cached trained tokenizer for this corpus and settings, training it if needed."""
    key = cache_key({"fingerprint": fingerprint, **settings.as_dict()})
    target = cache_dir / f"tokenizer-{key}"
    if not (target / MODEL_FILENAME).is_file():
        started = time.perf_counter()
        sentences = training_sentences(source.documents(), settings.train_chars)
        chars = sum(map(len, sentences))
        logger.info(
            "training a %d-piece tokenizer on %d characters in %d lines",
            settings.vocab_size,
            chars,
            len(sentences),
        )
        model = train_model(sentences, settings)
        with staged_directory(target) as staging:
            (staging / MODEL_FILENAME).write_bytes(model)
        logger.info("trained the tokenizer in %.1f s", time.perf_counter() - started)
    return Tokenizer.load(target)


# ----------------------------------------------------------------- fingerprints


def source_fingerprint(source: Source, cache_dir: Path) -> str:
    """The source's fingerprint; for local files, each file's digest is remembered by
    (path, size, mtime, inode) in ``<cache>/file-digests.json``, so a launch on an unchanged
    prepared corpus reads no corpus bytes."""
    if not isinstance(source, FileSetSource):
        return source.fingerprint()
    path = cache_dir / FILE_DIGESTS
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    changed = False

    def digest(file: Path) -> str:
        nonlocal changed
        stat = file.stat()
        stamp = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
        if stamp not in known:
            known[stamp] = sha256_of_file(file)
            changed = True
        return known[stamp]

    fingerprint = source.fingerprint(digest)
    if changed:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, known)
    return fingerprint


# ----------------------------------------------------------------- writing shards


def shard_name(index: int) -> str:
    return f"{index:06d}"


def complete_shards(directory: Path, dtype: np.dtype, shard_tokens: int) -> list[dict[str, Any]]:
    """The records of the shards ``000000..`` that are complete, in order.

    A shard is complete when its record parses and its ``.bin`` and ``.ends`` files have the
    recorded sizes; the first one that is not ends the list (later ones are rewritten).
    """
    records: list[dict[str, Any]] = []
    while True:
        name = shard_name(len(records))
        try:
            record = json.loads((directory / f"{name}.json").read_text())
            bin_size = (directory / f"{name}.bin").stat().st_size
            ends_size = (directory / f"{name}.ends").stat().st_size
        except (OSError, ValueError):
            return records
        if (
            bin_size != record.get("tokens", -1) * dtype.itemsize
            or ends_size != record.get("documents", -1) * 8
            or (records and records[-1]["tokens"] != shard_tokens)
        ):
            return records
        records.append(record)


class ShardWriter:
    """Cut the token stream into shards of ``shard_tokens`` and write each one atomically."""

    def __init__(
        self, directory: Path, records: list[dict[str, Any]], shard_tokens: int, dtype: np.dtype
    ) -> None:
        self.directory = directory
        self.records = records
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.parts: list[np.ndarray] = []
        self.buffered = 0
        self.ends: list[int] = []
        self.start = tuple(records[-1]["next"]) if records else (0, 0)

    def add(self, document: int, offset: int, ids: np.ndarray, ends_document: bool) -> None:
        """Append ``ids``, tokens ``offset..`` of ``document`` (its last ones if it ends)."""
        while ids.size:
            room = self.shard_tokens - self.buffered
            part = ids[:room]
            self.parts.append(part)
            self.buffered += part.size
            ids = ids[room:]
            offset += part.size
            if ends_document and not ids.size:
                self.ends.append(self.buffered)
            if self.buffered == self.shard_tokens:
                done = ends_document and not ids.size
                self.flush((document + 1, 0) if done else (document, offset))

    def flush(self, next_position: tuple[int, int]) -> None:
        """Write the buffered tokens as the next shard, then its record."""
        if not self.buffered:
            return
        name = shard_name(len(self.records))
        tokens = np.concatenate(self.parts).astype(self.dtype, copy=False)
        write_bytes_atomic(self.directory / f"{name}.bin", tokens)
        write_bytes_atomic(self.directory / f"{name}.ends", np.asarray(self.ends, dtype="<u8"))
        record = {
            "tokens": int(tokens.size),
            "documents": len(self.ends),
            "start": list(self.start),
            "next": list(next_position),
        }
        write_json_atomic(self.directory / f"{name}.json", record)
        self.records.append(record)
        self.start = next_position
        self.parts, self.buffered, self.ends = [], 0, []


def write_bytes_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array``'s bytes to ``path`` through a synced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as handle:
        array.tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_shards(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    directory: Path,
    shard_tokens: int,
    workers: int,
    progress: PrepareProgress,
) -> dict[str, Any]:
    """Tokenize ``documents`` into ``directory/shards``, resuming after complete shards.

    Returns the manifest, less the fields that describe the source and the tokenizer.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    shards_dir = directory / SHARDS_DIRNAME
    shards_dir.mkdir(exist_ok=True)
    for leftover in shards_dir.glob(".*.tmp"):  # in flight when a writer died; we hold the lock
        leftover.unlink()
    records = complete_shards(shards_dir, dtype, shard_tokens)
    writer = ShardWriter(shards_dir, records, shard_tokens, dtype)
    resume_document, resume_offset = writer.start
    if records:
        logger.info(
            "resuming the preparation after %d complete shards, at document %d",
            len(records),
            resume_document,
        )
    progress.tokens = progress.resumed_tokens = sum(r["tokens"] for r in records)
    progress.started = time.perf_counter()  # the rate counts tokenizing, not tokenizer training
    indexed = islice(enumerate(documents), resume_document, None)
    num_documents = resume_document
    for first, lengths, tokens, chars in encode_documents(indexed, tokenizer, dtype, workers):
        cursor = 0
        for number, length in enumerate(lengths.tolist()):
            document = first + number
            ids = tokens[cursor : cursor + length]
            cursor += length
            offset = 0
            if document == resume_document and resume_offset:
                ids, offset = ids[resume_offset:], resume_offset
            writer.add(document, offset, ids, ends_document=True)
            num_documents = document + 1
        progress.update(int(tokens.size), chars, len(writer.records))
    writer.flush((num_documents, 0))
    records = writer.records
    progress.update(0, 0, len(records))
    total = sum(r["tokens"] for r in records)
    if total == 0:
        raise DataError("the corpus produced no tokens")
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "shard_tokens": shard_tokens,
        "num_shards": len(records),
        "num_documents": num_documents,
        "total_tokens": total,
        "shards": [
            {
                "file": f"{SHARDS_DIRNAME}/{shard_name(i)}.bin",
                "ends": f"{SHARDS_DIRNAME}/{shard_name(i)}.ends",
                "tokens": r["tokens"],
                "documents": r["documents"],
            }
            for i, r in enumerate(records)
        ],
    }


# ----------------------------------------------------------------- parallel encoding

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    """Pool initializer: each worker opens the tokenizer once, single-threaded."""
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.load(tokenizer_path)
    _worker_tokenizer.single_threaded()


def encode_task(
    task: tuple[int, list[str]], tokenizer: Tokenizer | None = None, dtype: str = "uint32"
) -> tuple[int, np.ndarray, np.ndarray, int]:
    """Encode a batch of consecutive documents, each followed by the end-of-text id.

    Returns the first document's index, each document's token count, all tokens, and the
    number of characters encoded.
    """
    tokenizer = tokenizer or _worker_tokenizer
    assert tokenizer is not None
    first, texts = task
    split = [list(split_after_newlines(text, PIECE_CHARS)) for text in texts]
    encoded = iter(tokenizer.encode_batch(piece for pieces in split for piece in pieces))
    eot = [tokenizer.eot_id]
    parts: list[list[int]] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for number, pieces in enumerate(split):
        document = [next(encoded) for _ in pieces]
        document.append(eot)
        lengths[number] = sum(map(len, document))
        parts.extend(document)
    tokens = np.fromiter(chain.from_iterable(parts), dtype=dtype, count=int(lengths.sum()))
    return first, lengths, tokens, sum(map(len, texts))


def document_tasks(indexed: Iterable[tuple[int, str]]) -> Iterator[tuple[int, list[str]]]:
    """Group ``(index, text)`` pairs into tasks of about ``TASK_CHARS`` characters."""
    first, texts, chars = -1, [], 0
    for index, text in indexed:
        if not texts:
            first = index
        texts.append(text)
        chars += len(text)
        if chars >= TASK_CHARS or len(texts) >= TASK_DOCUMENTS:
            yield first, texts
            texts, chars = [], 0
    if texts:
        yield first, texts


def encode_documents(
    indexed: Iterable[tuple[int, str]], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """Encode tasks in order, in ``workers`` processes (in this one when ``workers`` is 1).

    At most ``4 * workers`` tasks are in flight, so memory stays bounded however slowly the
    shards are written.
    """
    tasks = document_tasks(indexed)
    if workers == 1:  # one process, one thread: the baseline the parallel run is measured by
        tokenizer.single_threaded()
        for task in tasks:
            yield encode_task(task, tokenizer, dtype.name)
        return
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, _init_worker, (str(tokenizer.model_path),)) as pool:
        pending: deque[Any] = deque()
        for task in tasks:
            pending.append(pool.apply_async(encode_task, (task, None, dtype.name)))
            if len(pending) >= PENDING_TASKS_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def load_prepared(directory: Path) -> tuple[dict[str, Any], Tokenizer]:
    """The manifest and tokenizer of a prepared corpus, checked against each other and the
    shards on disk."""
    manifest = load_manifest(directory)
    tokenizer = Tokenizer.load(directory / manifest["tokenizer"]["file"])
    check_prepared(directory, manifest, tokenizer.sha256())
    return manifest, tokenizer
