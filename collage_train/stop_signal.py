"""A preemption signal (SIGTERM, SIGINT) turned into a flag the training loop reads.

Clusters announce preemption with SIGTERM some seconds before the kill; the loop checks
the flag at its next settle, saves a checkpoint on every rank and exits cleanly instead
of dying mid-step.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class StopRequest:
    """Records the name of the first stop signal received while ``installed``."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGTERM and SIGINT inside the context; restore the previous handlers."""
        previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
