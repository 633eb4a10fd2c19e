"""Progress of a corpus preparation: the console line, the heartbeat file, and waiting on it.

The process that prepares a corpus rewrites ``progress.json`` in the cache entry every few
seconds (atomically). Other processes that need the same corpus (the other ranks of a
launch, a second ``prepare`` on a shared file system) poll for the entry's manifest and
print the preparer's progress meanwhile: a file-based wait that no collective timeout
bounds. A preparation that fails writes its error there, and the waiters raise it; one that
is killed stops beating, and the waiters give up after ``STALL_SECONDS``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from collage_train.data.errors import DataError

logger = logging.getLogger(__name__)

PROGRESS_FILENAME = "progress.json"
HEARTBEAT_SECONDS = 2.0
REPORT_SECONDS = 30.0
POLL_SECONDS = 1.0
STALL_SECONDS = 600.0
FRESH_FAILURE_SECONDS = 30.0  # an older failure is a previous launch's, not this one's


def format_count(value: float) -> str:
    """``1234567`` -> ``1.23M``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f}{unit}"
    return f"{value:.0f}"


def format_seconds(seconds: float) -> str:
    """``3725`` -> ``1h02m``; ``75`` -> ``1m15s``."""
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a flushed temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as handle:
        handle.write(json.dumps(obj, indent=1, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class PrepareProgress:
    """Counts tokens and input characters; prints a progress line and beats the heartbeat.

    ``total_chars`` (the input's size, when known) gives the fraction done and the ETA.
    On a terminal the line is redrawn in place; otherwise it is logged every 30 s.
    """

    def __init__(
        self,
        directory: Path,
        total_chars: int | None,
        done_tokens: int = 0,
        stream: TextIO | None = None,
    ) -> None:
        self.directory = directory
        self.total_chars = total_chars
        self.tokens = done_tokens
        self.resumed_tokens = done_tokens
        self.chars = 0
        self.shards = 0
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty()
        self.started = time.perf_counter()
        self._last_beat = self._last_report = 0.0
        self.beat(state="preparing", force=True)

    def update(self, tokens: int, chars: int, shards: int) -> None:
        """Add a batch's tokens and characters; ``shards`` is the count complete so far."""
        self.tokens += tokens
        self.chars += chars
        self.shards = shards
        now = time.perf_counter()
        if now - self._last_beat >= HEARTBEAT_SECONDS:
            self.beat(state="preparing")
            if self.interactive:
                print(f"\r{self.line()}", end="", file=self.stream, flush=True)
        if not self.interactive and now - self._last_report >= REPORT_SECONDS:
            self._last_report = now
            logger.info("%s", self.line())

    def rate(self) -> float:
        """Tokens per second written by this process (resumed shards excluded)."""
        elapsed = time.perf_counter() - self.started
        return (self.tokens - self.resumed_tokens) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """``prepare: 12.3M tokens in 5 shards, 1.20M tokens/s, 41% of the input, ETA 3m10s``."""
        text = (
            f"prepare: {format_count(self.tokens)} tokens in {self.shards} shards, "
            f"{format_count(self.rate())} tokens/s"
        )
        if self.total_chars:
            fraction = min(self.chars / self.total_chars, 0.999)
            elapsed = time.perf_counter() - self.started
            eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("inf")
            eta_text = format_seconds(eta) if eta != float("inf") else "?"
            text += f", ~{100 * fraction:.0f}% of the input, ETA ~{eta_text}"
        return text

    def beat(self, state: str, force: bool = False, error: str | None = None) -> None:
        """Rewrite ``progress.json`` (at most every ``HEARTBEAT_SECONDS`` unless ``force``)."""
        now = time.perf_counter()
        if not force and now - self._last_beat < HEARTBEAT_SECONDS:
            return
        self._last_beat = now
        record = {
            "state": state,
            "writer": f"{os.getpid()}@{socket.gethostname()}",
            "time": time.time(),
            "tokens": self.tokens,
            "shards": self.shards,
            "line": self.line(),
        }
        if error is not None:
            record["error"] = error
        write_json_atomic(self.directory / PROGRESS_FILENAME, record)

    def finish(self) -> None:
        """End the progress line and record completion."""
        if self.interactive:
            print(f"\r{self.line()}", file=self.stream, flush=True)
        logger.info(
            "prepared %d tokens in %d shards in %.1f s (%s tokens/s)",
            self.tokens,
            self.shards,
            time.perf_counter() - self.started,
            format_count(self.rate()),
        )
        self.beat(state="done", force=True)

    def fail(self, error: BaseException) -> None:
        """Record that the preparation failed, so that waiters stop with its message."""
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        self.beat(state="failed", force=True, error=message)


def read_progress(directory: Path) -> dict[str, Any] | None:
    """The preparer's last heartbeat, or None if there is none (yet) or it is being replaced."""
    try:
        return json.loads((directory / PROGRESS_FILENAME).read_text())
    except (OSError, ValueError):
        return None


def wait_for_preparation(
    directory: Path,
    done: Path,
    *,
    stall_seconds: float = STALL_SECONDS,
    poll_seconds: float = POLL_SECONDS,
    stream: TextIO | None = None,
) -> None:
    """Block until ``done`` exists, printing the preparer's progress every 30 s.

    Raises DataError when the preparer reports a failure (one written before this wait
    began, less ``FRESH_FAILURE_SECONDS``, belongs to an earlier launch and is ignored), or
    when neither ``done`` nor a heartbeat newer than ``stall_seconds`` shows up (the
    preparer died or never started).
    """
    stream = stream if stream is not None else sys.stderr
    started = time.time()
    last_report = started
    print(f"waiting for the corpus preparation in {directory}", file=stream, flush=True)
    while not done.exists():
        progress = read_progress(directory)
        now = time.time()
        failed = progress is not None and progress.get("state") == "failed"
        if failed and float(progress.get("time", 0)) >= started - FRESH_FAILURE_SECONDS:
            raise DataError(
                f"the corpus preparation in {directory} failed ({progress.get('error')}); "
                "fix that and launch again"
            )
        last_sign = max(started, float(progress["time"])) if progress else started
        if now - last_sign > stall_seconds:
            raise DataError(
                f"no progress from the corpus preparation in {directory} for "
                f"{format_seconds(now - last_sign)} (writer "
                f"{progress.get('writer') if progress else 'never started'}); run "
                "python -m collage_train.prepare with the same data settings, then launch again"
            )
        if now - last_report >= REPORT_SECONDS:
            last_report = now
            line = progress.get("line") if progress else "not started yet"
            print(f"waiting for the corpus preparation: {line}", file=stream, flush=True)
        time.sleep(poll_seconds)
