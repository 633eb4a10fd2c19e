"""The costliest test files first: how ``make test`` keeps both cores busy to the end.

``make test`` shares the suite out file by file (``-n auto --dist loadfile``), handing a
worker the next file whenever it finishes one. pytest-xdist would order the files by their
number of tests, so single-test files that launch ranks for 20 s came last and one worker
finished up to half a minute after the other. With ``--no-loadscope-reorder`` the files go
out in collection order, which each worker sets here: by the seconds each file took in a
measured run (tests/file_costs.json), the costliest first, so that what is left at the
end is small. (Launches then run beside launches early on, which costs them some speed:
both workers finished at 301 s in one measured run, against 272 and 299 s in xdist's
order.) A file the record does not know counts as ``UNKNOWN_COST``; the record only
orders, so a stale one costs balance, never a result.

``pytest --store-file-costs`` (``make test ARGS=--store-file-costs``) writes the files
it ran into the record, from that run's setup, call and teardown times.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

RECORD = Path(__file__).resolve().parents[1] / "file_costs.json"
UNKNOWN_COST = 1.0  # seconds: about a typical file's


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(record: Path = RECORD) -> dict[str, float]:
    """Seconds per test file (``tests/...py``), as recorded; empty without a record."""
    return json.loads(record.read_text()) if record.is_file() else {}


def costliest_first(items: Sequence[Any], costs: dict[str, float]) -> list[Any]:
    """``items`` (anything with a ``nodeid``) with whole files moved by recorded cost,
    the costliest first; a file's own items keep their order, files of equal cost theirs."""
    by_file: dict[str, list[Any]] = {}
    for item in items:
        by_file.setdefault(file_of(item.nodeid), []).append(item)
    files = sorted(by_file, key=lambda name: -costs.get(name, UNKNOWN_COST))
    return [item for name in files for item in by_file[name]]


def order_for_worker(config: pytest.Config, items: list[Any]) -> None:
    """On a pytest-xdist worker, ``items`` in place, the costliest files first (a plain
    run keeps pytest's order)."""
    if hasattr(config, "workerinput"):
        items[:] = costliest_first(items, load())


def refuse_part_of_a_file(markexpr: str, keyword: str, args: list[str]) -> None:
    """A run that leaves some of a file's tests out would record that file as cheaper
    than it is: ``--store-file-costs`` takes no ``-m``, ``-k`` or test ids."""
    if markexpr or keyword or any("::" in arg for arg in args):
        raise pytest.UsageError(
            "--store-file-costs records whole files: run it without -m, -k or test ids"
        )


class CostRecorder:
    """Sums each file's setup, call and teardown seconds over a run and writes them into
    ``record`` at its end (one decimal, sorted by file): the files this run ran replace
    their entries, the others stay unless their file is gone (the record's paths are
    relative to the folder above tests/). Registered in the process that reports
    (pytest-xdist's controller gets every worker's reports)."""

    def __init__(self, record: Path = RECORD) -> None:
        self.record = record
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.seconds:
            return
        root = self.record.parent.parent
        costs = {name: cost for name, cost in load(self.record).items() if (root / name).is_file()}
        costs.update({name: round(seconds, 1) for name, seconds in self.seconds.items()})
        self.record.write_text(json.dumps(dict(sorted(costs.items())), indent=0) + "\n")
