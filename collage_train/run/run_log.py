"""Where a run's records and lines go while it trains.

``RunLog`` hands every record to the sinks (``metrics.sinks``: console, ``metrics.jsonl``,
W&B) and prints rank 0's console lines; it keeps the last training record and the last
validation result, which the run's summary reports (``run.report.run_summary``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collage_train.metrics.sinks import Sink
from collage_train.run import report
from collage_train.run.step_window import StepRecord


class RunLog:
    """The sinks and the console of one launch."""

    def __init__(self, sinks: Sequence[Sink], *, is_main: bool, tokens_per_step: int) -> None:
        self.sinks = sinks
        self._is_main = is_main
        self._tokens_per_step = tokens_per_step
        self.last_train: dict[str, Any] | None = None
        self.last_validation: dict[str, float] | None = None

    def record(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def at_step(self, step: int, values: dict[str, Any]) -> None:
        """A record of ``values`` at ``step`` (with its tokens); nothing when empty."""
        if values:
            self.record({"step": step, "tokens": step * self._tokens_per_step, **values})

    def notice(self, line: str) -> None:
        """A console line, printed once (rank 0)."""
        if self._is_main:
            print(line, flush=True)

    def skips(self, records: list[dict[str, Any]]) -> None:
        """A refused step's record each, with its warning line."""
        for record in records:
            self.notice(f"warning: {record.pop('line')}")
            self.record(record)

    def train(
        self, facts: report.RunFacts, progress: report.RunProgress, window: list[StepRecord]
    ) -> None:
        """The record of the settled steps since the last one (``run.report.train_record``)."""
        self.last_train = report.train_record(facts, progress, window)
        self.record(self.last_train)

    def validation(self, step: int, results: dict[str, float]) -> None:
        self.last_validation = results
        self.at_step(step, results)
