"""tests/support/file_costs.py: make test's workers take the costliest files first."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import file_costs
import pytest

REPO = Path(__file__).resolve().parents[1]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_whole_files_move_by_recorded_cost_and_keep_their_own_order():
    items = _items("a.py::x", "b.py::x", "a.py::y", "c.py::x", "d.py::x", "b.py::y")
    costs = {"a.py": 0.5, "b.py": 30.0, "d.py": 0.5}  # c.py unrecorded: UNKNOWN_COST, 1 s
    ordered = [item.nodeid for item in file_costs.costliest_first(items, costs)]
    assert ordered == ["b.py::x", "b.py::y", "c.py::x", "a.py::x", "a.py::y", "d.py::x"]


def test_a_run_records_each_files_setup_call_and_teardown_seconds(tmp_path):
    """... into the record: what it ran replaces its entries, what it did not run stays,
    a file that is gone leaves."""
    (tmp_path / "t").mkdir()
    for name in ("a.py", "b.py", "kept.py"):
        (tmp_path / "t" / name).touch()
    record = tmp_path / "t" / "costs.json"  # paths in it: from the folder above
    record.write_text(json.dumps({"t/a.py": 9.0, "t/kept.py": 4.0, "t/gone.py": 3.0}))
    recorder = file_costs.CostRecorder(record)
    for nodeid, duration in [("t/b.py::x", 0.25), ("t/a.py::x", 2.0), ("t/b.py::x", 1.0),
                             ("t/b.py::y[1]", 0.5)]:  # fmt: skip
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))
    recorder.pytest_sessionfinish(SimpleNamespace())
    assert file_costs.load(record) == {"t/a.py": 2.0, "t/b.py": 1.8, "t/kept.py": 4.0}
    assert list(file_costs.load(record)) == ["t/a.py", "t/b.py", "t/kept.py"]
    assert file_costs.load(tmp_path / "none.json") == {}


def test_workers_collect_in_that_order_and_the_scheduler_keeps_it(request, monkeypatch):
    """A pytest-xdist worker's collection is ordered (this one's too, when this suite runs
    under make test), a plain run's is not; make test tells pytest-xdist not to re-sort
    the files by their number of tests."""
    if hasattr(request.config, "workerinput"):
        collected = request.session.items  # the order is its own fixed point
        assert file_costs.costliest_first(collected, file_costs.load()) == collected
    items = _items("tests/cheap.py::a", "tests/dear.py::a")
    monkeypatch.setattr(file_costs, "load", lambda: {"tests/dear.py": 9.0})
    file_costs.order_for_worker(SimpleNamespace(), items)
    assert [item.nodeid for item in items] == ["tests/cheap.py::a", "tests/dear.py::a"]
    file_costs.order_for_worker(SimpleNamespace(workerinput={"workerid": "gw0"}), items)
    assert [item.nodeid for item in items] == ["tests/dear.py::a", "tests/cheap.py::a"]
    (recipe,) = [line for line in (REPO / "Makefile").read_text().splitlines() if "pytest" in line]
    assert "--dist loadfile --no-loadscope-reorder" in recipe


def test_the_record_names_test_files_of_this_checkout():
    recorded = file_costs.load()
    assert recorded and all(cost >= 0 for cost in recorded.values())
    missing = [name for name in recorded if not (REPO / name).is_file()]
    assert not missing, f"renamed or removed: {missing}; make test ARGS=--store-file-costs"


def test_a_run_of_part_of_a_file_is_not_recorded():
    file_costs.refuse_part_of_a_file("", "", ["tests/optim", "tests/planning/test_batch.py"])
    for markexpr, keyword, args in [
        ("not slow", "", []),
        ("", "zero", []),
        ("", "", ["tests/planning/test_batch.py::test_a"]),
    ]:
        with pytest.raises(pytest.UsageError, match="records whole files"):
            file_costs.refuse_part_of_a_file(markexpr, keyword, args)
