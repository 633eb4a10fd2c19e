"""A per-rank hang watchdog: when no optimizer step completes for too long, record where
every thread is and exit with a status of its own, so that a scheduler restarts the job.

``HangWatchdog`` is a daemon thread: the loop calls ``beat`` after every optimizer step
and wraps its known long phases (validation, a save's blocked part, the stop's
checkpoint) in ``paused``. When the time since the last beat, outside a pause, passes
the bound (``train.hang_timeout_s``; ``None``: ``HANG_FACTOR`` times the longest of the
first ``MEASURED_STEPS`` steps, at least ``HANG_FLOOR_S``; armed from the second step), it
writes ``hang-rank{R}-<time>.txt`` into the run directory (every thread's Python stack,
then the collectives in flight), repeats the stacks on stderr, prints one ``error:`` line
and ends the process with ``HUNG`` (3, ``collage_train.errors``), writing nothing else, so
``train.resume=true`` continues the run. While it is armed the collective timeout is
``collective_timeout_s`` (twice the bound, at least five minutes), put back to
``distributed.timeout_minutes`` in a pause and at the end.
Why, and how a scheduler restarts the job: docs/distributed.md, "A hung rank: the watchdog".
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from collage_train.errors import HUNG, ConfigError, first_line

HANG_FLOOR_S = 300.0  # the smallest derived bound: a slow disk or a GC pause is not a hang
HANG_FACTOR = 10.0  # derived bound: this many times the longest measured step
MEASURED_STEPS = 8  # step intervals measured before a derived bound is armed
COLLECTIVE_FLOOR_S = 300.0  # the lowered collective timeout is never shorter
EXIT_GRACE_S = 60.0  # the process exits this long after firing even if writing hangs


def collective_timeout_s(hang_timeout_s: float) -> float:
    """The collective timeout while steps are watched: twice the hang bound, so that the
    watchdog, which records where each rank is, fires first; at least five minutes."""
    return max(2.0 * hang_timeout_s, COLLECTIVE_FLOOR_S)


def set_collective_timeout(seconds: float) -> bool:
    """Set the default process group's timeout for the collectives issued from now on
    (``torch.distributed.distributed_c10d._set_pg_timeout``, gloo and NCCL); False where
    there is no group or this torch lacks the call."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    setter(timedelta(seconds=seconds))
    return True


def collectives_in_flight() -> str:
    """The collectives this process has not completed, from torch's flight recorder
    (recording while ``TORCH_FR_BUFFER_SIZE`` > 0 when the group was made; the launch sets
    2000 unless told otherwise, ``engine.launch.init_process_group``)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "no process group: no collective in flight"
    c10d = torch._C._distributed_c10d
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json")  # JSON: nothing is unpickled
    dump = next((getattr(c10d, n) for n in names if hasattr(c10d, n)), None)
    if dump is None:
        return f"not available: this torch has no flight recorder ({dist.get_backend()})"
    try:
        trace = json.loads(dump(True, False))  # this process's own record, every entry
    except Exception as err:  # a build without it, or a recorder that is off
        return f"not available on {dist.get_backend()} ({first_line(err)})"
    entries = trace.get("entries", [])
    if not entries:
        return "the flight recorder holds nothing (TORCH_FR_BUFFER_SIZE=0?)"
    pending = [e for e in entries if e.get("state") != "completed" and not e.get("retired")]
    lines = [f"{len(pending)} of the last {len(entries)} collectives not completed:"]
    for entry in pending or entries[-1:]:
        sizes = entry.get("input_sizes")
        lines.append(
            f"  {entry.get('profiling_name')} seq {entry.get('collective_seq_id')} "
            f"group {entry.get('process_group')} sizes {sizes} state {entry.get('state')}"
        )
    return "\n".join(lines)


class HangWatchdog:
    """Fires when no ``beat`` came for ``timeout_s`` outside ``paused`` (see the module).

    ``timeout_s``: the bound in seconds, None to derive it, 0 for no watchdog at all.
    ``collective_s``: the configured collective timeout, restored in pauses and at the end.
    ``exit`` ends the process (``os._exit``: no cleanup runs that could block on the hang).
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        timeout_s: float | None,
        *,
        collective_s: float | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ConfigError(
                f"train.hang_timeout_s must be 0 (off), a number of seconds or null "
                f"(derived from the step time), got {timeout_s}"
            )
        self.run_dir = run_dir
        self.rank = rank
        self.enabled = timeout_s != 0
        self.timeout_s: float | None = timeout_s or None  # None until derived
        self.collective_s = collective_s
        self._exit = exit
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: float | None = None  # time.monotonic() of the last beat or pause end
        self._step = 0
        self._beats = 0
        self._pauses = 0
        self._spans_pause = False  # the running interval includes a pause: not measured
        self._measured: list[float] = []
        self._short_collectives = False
        self.fired_path: Path | None = None

    @property
    def armed(self) -> bool:
        return self.enabled and self._beats >= 2 and self.timeout_s is not None

    @contextlib.contextmanager
    def watching(self) -> Iterator[HangWatchdog]:
        """Run the watchdog thread inside the context (none when off)."""
        if self.enabled:
            self._stopped.clear()
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()
        try:
            yield self
        finally:
            self._stopped.set()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self._collectives(short=False)

    def beat(self, step: int) -> None:
        """Record that optimizer step ``step`` completed on this rank."""
        now = time.monotonic()
        with self._lock:
            measuring = self.timeout_s is None and len(self._measured) < MEASURED_STEPS
            # from the second step on, and not across a pause
            if measuring and self._last is not None and self._beats >= 2 and not self._spans_pause:
                self._measured.append(now - self._last)
                if len(self._measured) == MEASURED_STEPS:
                    self.timeout_s = max(HANG_FLOOR_S, HANG_FACTOR * max(self._measured))
            self._last, self._step, self._spans_pause = now, step, False
            self._beats += 1
            armed = self.armed and self._pauses == 0
        if armed:
            self._collectives(short=True)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A known long phase: the watchdog does not fire inside it, and collectives get the
        configured timeout back; the time to the next beat counts from its end."""
        with self._lock:
            self._pauses += 1
        self._collectives(short=False)
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                self._last, self._spans_pause = time.monotonic(), True
                armed = self.armed and self._pauses == 0
            if armed:
                self._collectives(short=True)

    def _collectives(self, *, short: bool) -> None:
        """Lower the collective timeout while armed; restore the configured one otherwise
        (called on the main thread only, where the collectives are issued)."""
        if short == self._short_collectives or self.collective_s is None:
            return
        assert self.timeout_s is not None or not short
        seconds = collective_timeout_s(self.timeout_s) if short else self.collective_s
        if set_collective_timeout(min(seconds, self.collective_s)):
            self._short_collectives = short

    def _watch(self) -> None:
        while True:
            bound = self.timeout_s
            poll = 1.0 if bound is None else min(1.0, max(0.02, bound / 20))
            if self._stopped.wait(poll):
                return
            with self._lock:
                if not self.armed or self._pauses or self._last is None:
                    continue
                since = time.monotonic() - self._last
                step = self._step
            assert self.timeout_s is not None
            if since > self.timeout_s:
                self._fire(step, since)
                return

    def _fire(self, step: int, since: float) -> None:
        """Record every thread's stack and the collectives in flight, then exit ``HUNG``."""
        # a hung file system must not keep the process alive: exit regardless after a grace
        timer = threading.Timer(EXIT_GRACE_S, self._exit, args=(HUNG,))
        timer.daemon = True
        timer.start()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.run_dir / f"hang-rank{self.rank}-{stamp}.txt"
        header = (
            f"rank {self.rank}: no optimizer step completed for {since:.0f} s "
            f"(train.hang_timeout_s bound {self.timeout_s:.0f} s); last completed step {step}\n"
        )
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(sys.stderr, all_threads=True)  # the job's log
        written = f"every thread's stack is in {path}"
        try:
            with path.open("w") as out:
                out.write(header + "\nPython stacks (most recent call first):\n")
                out.flush()
                faulthandler.dump_traceback(out, all_threads=True)
                out.write("\nCollectives in flight:\n" + collectives_in_flight() + "\n")
        except OSError as err:
            written = f"the stacks could not be written to {path} ({err}); they are above"
        self.fired_path = path
        print(
            f"error: [rank {self.rank}] hung: no optimizer step completed for {since:.0f} s "
            f"after step {step} (train.hang_timeout_s {self.timeout_s:.0f} s); {written}; "
            f"exiting with status {HUNG}: restart with train.resume=true",
            file=sys.stderr,
            flush=True,
        )
        self._exit(HUNG)


def for_run(cfg_train: Any, cfg_distributed: Any, run_dir: Path, rank: int) -> HangWatchdog:
    """The watchdog of one run: ``train.hang_timeout_s``, and the configured collective
    timeout ``distributed.timeout_minutes`` to restore."""
    return HangWatchdog(
        run_dir,
        rank,
        cfg_train.get("hang_timeout_s"),
        collective_s=60.0 * cfg_distributed.timeout_minutes,
    )
