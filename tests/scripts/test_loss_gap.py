"""scripts/loss_gap.py: the step-by-step loss gap gpu_check.sh judges ZeRO and elastic runs by."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runner import REPO

sys.path.insert(0, str(REPO / "scripts"))
import loss_gap


def run_dir(path: Path, losses: dict[int, float]) -> Path:
    path.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": loss, "lr": 1e-3}) for s, loss in losses.items()]
    lines.insert(2, json.dumps({"step": 2, "val_loss": 9.0}))  # validation records are not steps
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def gap(*args: str) -> SimpleNamespace:
    """The script's ``main`` in this process: its exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = loss_gap.main(list(args))
    return SimpleNamespace(returncode=status, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture
def runs(tmp_path):
    reference = run_dir(tmp_path / "ref", {1: 10.0, 2: 8.0, 3: 6.0, 4: 5.0})
    close = run_dir(tmp_path / "close", {1: 10.0, 2: 8.04, 3: 6.0, 4: 5.01})
    far = run_dir(tmp_path / "far", {1: 10.0, 2: 8.0, 3: 6.3, 4: 5.0})
    return reference, close, far


def test_the_largest_gap_and_its_step_against_the_tolerance(runs, tmp_path):
    reference, close, far = runs
    out = tmp_path / "gap.json"
    done = gap(str(reference), str(close), str(far), "--rtol", "0.01", "--json", str(out))
    assert done.returncode == 1  # far is beyond 1%
    rows = {Path(r["run"]).name: r for r in json.loads(out.read_text())["rows"]}
    assert rows["close"]["max_abs_diff"] == pytest.approx(0.04)
    assert rows["close"]["max_abs_diff_step"] == 2 and rows["close"]["within_tolerance"]
    assert rows["close"]["max_rel_diff"] == pytest.approx(0.005)
    assert rows["far"]["max_rel_diff"] == pytest.approx(0.05)
    assert rows["far"]["max_rel_diff_step"] == 3 and not rows["far"]["within_tolerance"]
    assert rows["far"]["steps"] == 4 and rows["far"]["rtol"] == 0.01
    assert "beyond rtol 0.01" in done.stdout and "within rtol 0.01" in done.stdout
    assert gap(str(reference), str(close), "--rtol", "0.01").returncode == 0


def test_from_step_compares_only_what_follows_a_resume(runs):
    reference, _, far = runs
    done = gap(str(reference), str(far), "--from-step", "4", "--rtol", "1e-9")
    assert done.returncode == 0 and "1 steps (4-4)" in done.stdout


def test_runs_that_cannot_be_compared_are_one_error_line(runs, tmp_path):
    reference, _, _ = runs
    short = run_dir(tmp_path / "short", {1: 10.0, 2: 8.0})
    for args, message in (
        ((str(reference), str(short)), "the runs logged different steps"),
        ((str(reference), str(tmp_path / "none")), "has no metrics.jsonl"),
        ((str(reference), str(reference), "--from-step", "9"), "no logged step at or after"),
    ):
        done = gap(*args)
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("error: ") and message in line, line
