"""A preemption signal (SIGTERM, SIGINT) turned into a flag, and the ranks' agreement on it.

Clusters announce preemption with SIGTERM some seconds before the kill (docs/preemption.md).
``StopRequest`` records the first such signal; ``StopAgreement`` makes every rank act on it
at the same optimizer step, at most two steps after it lands, without the host ever waiting
for the device: after each step every rank starts an all-reduce of its flag on a host-only
(gloo) group and reads the result one step later, when it has long arrived.

A second SIGINT while stopping raises ``KeyboardInterrupt`` (Ctrl-C twice aborts); a
repeated SIGTERM, which arrives when both Slurm and a launcher forward it, is ignored.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class StopRequest:
    """Records the first stop signal received while ``installed``: its name and when."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None  # time.monotonic() in the handler
        self.received_wall: float | None = None  # time.time(): comparable across hosts

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal_name is None:
            self.received_at = time.monotonic()
            self.received_wall = time.time()
            self.signal_name = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt(f"SIGINT while stopping on {self.signal_name}: aborted")
        # a repeated SIGTERM changes nothing: the stop is already under way

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGTERM and SIGINT inside the context; restore the previous handlers.

        Nested inside another request's context (a sweep's, ``collage_train.run.sweep_stop``),
        it starts with the signal that one holds already and hands it the signal it
        received: a signal lands in whichever request is installed, and both learn of it."""
        previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        outer = getattr(previous[signal.SIGTERM], "__self__", None)
        outer = outer if isinstance(outer, StopRequest) else None
        if outer is not None:
            self._adopt(outer)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if outer is not None:
                outer._adopt(self)

    def _adopt(self, other: StopRequest) -> None:
        """Take ``other``'s signal if this request has none yet."""
        if self.signal_name is None and other.signal_name is not None:
            self.signal_name = other.signal_name
            self.received_at, self.received_wall = other.received_at, other.received_wall


def stop_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for ``StopAgreement``; None outside a multi-rank launch.

    Every rank must call it at the same point (``dist.new_group`` is collective). Its
    tensors live in host memory, so agreeing on a stop never touches the GPU; on a
    multi-node GPU run gloo picks its network interface like a CPU run does
    (``GLOO_SOCKET_IFNAME``, docs/distributed.md).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


class StopAgreement:
    """Turns one rank's ``StopRequest`` into the same stop step on every rank.

    Call ``after_step()`` once per optimizer step on every rank. With several ranks the
    flag this rank holds after step k (``[-signal wall time, signal number]``, or ``-inf``
    and 0 without a signal) is all-reduced (MAX) asynchronously on ``group`` and read after
    step k + 1; every rank reads the same reduced value, so all of them return True after
    the same step. A signal landing anywhere in step k (after step k - 1's ``after_step``
    read its flag) is therefore acted on after step k + 1: within two optimizer steps.
    One process decides at the step the signal landed in, without communication.
    """

    def __init__(
        self, request: StopRequest, world_size: int, group: dist.ProcessGroup | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if world_size > 1 and group is None:
            raise ValueError("several ranks agree on a stop through a group: use stop_group()")
        if group is not None and dist.get_world_size(group) != world_size:
            raise ValueError(
                f"the stop group holds {dist.get_world_size(group)} ranks, not {world_size}"
            )
        self.request = request
        self.world_size = world_size
        self.group = group
        self.steps = 0  # after_step calls so far
        self.stop_step: int | None = None  # the call that returned True first
        self.signal_step: int | None = None  # the call during whose step this rank's signal came
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._agreed_wall: float | None = None  # earliest signal on any rank (time.time())
        self._agreed_signum = 0
        self.failed = False  # a rank stopped the run because its checkpoint write failed

    def _local_flag(self, failed: bool) -> torch.Tensor:
        wall = self.request.received_wall
        signum = signal.Signals[self.request.signal_name].value if wall is not None else 0
        flag = [-wall if wall is not None else -math.inf, float(signum), float(failed)]
        return torch.tensor(flag, dtype=torch.float64)  # host memory: no device involved

    def after_step(self, failed: bool = False) -> bool:
        """Whether every rank must stop now (after the step just taken); the same on all.

        ``failed``: this rank must stop without a signal (its background checkpoint write
        failed); every rank then stops at the same step, ``failed`` set on all of them.
        """
        self.steps += 1
        if self.request.signal_name is not None and self.signal_step is None:
            self.signal_step = self.steps  # it landed after the previous call: in this step
        if self.stop_step is not None:
            return True
        if self.world_size == 1:
            if self.request.signal_name is None and not failed:
                return False
            self._agreed_wall = self.request.received_wall
            self.failed = failed
            self.stop_step = self.steps
            return True
        decided = False
        if self._pending is not None:  # launched after the previous step: long done
            work, reduced = self._pending
            work.wait()
            self._pending = None
            neg_wall, signum, any_failed = reduced.tolist()  # a host tensor: no device sync
            if neg_wall != -math.inf:
                self._agreed_wall, self._agreed_signum = -neg_wall, int(signum)
                decided = True
            if any_failed:
                self.failed = decided = True
        if decided:  # every rank decided at this step, so none launches another
            self.stop_step = self.steps
            return True
        flag = self._local_flag(failed)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, flag)
        return False

    @property
    def signal_name(self) -> str | None:
        """The signal this rank received, else one another rank received (once agreed)."""
        if self.request.signal_name is not None:
            return self.request.signal_name
        if self._agreed_signum:
            return signal.Signals(self._agreed_signum).name
        return None

    def elapsed(self) -> float | None:
        """Seconds since the stop signal: this rank's own (monotonic clock), else the
        earliest any rank received (wall clocks, as synchronised as the hosts' are)."""
        if self.request.received_at is not None:
            return time.monotonic() - self.request.received_at
        if self._agreed_wall is not None:
            return max(0.0, time.time() - self._agreed_wall)
        return None

    def describe(self, step: int) -> str:
        """The line saying the run stopped at ``step`` on the signal, its checkpoint saved."""
        elapsed = self.elapsed()
        took = f", {elapsed:.1f} s after the signal" if elapsed is not None else ""
        landed = step - self.stop_step + self.signal_step if self.signal_step else None
        during = f" during step {landed}" if landed is not None else " on another rank"
        return (
            f"{self.signal_name or 'a stop signal'} received{during}: checkpoint saved at "
            f"step {step}{took}; continue with train.resume=true"
        )

    def finish(self) -> None:
        """Wait for an all-reduce still in flight, so nothing is pending at exit."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()
